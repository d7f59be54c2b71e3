"""Command line: ``attnchecker <command>``. Thin: parse, build one config, call the library."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from attnchecker.demo import run_math_demo, run_model_demo

    records = run_math_demo(seed=args.seed)
    failed = [r for r in records[:-1] if r["status"] == "missed"]
    model = run_model_demo(family=args.family, seed=args.seed)
    failed += [r for r in model if r["protected_grad_diff"] > 1e-5]
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    from attnchecker import __version__

    p = argparse.ArgumentParser(prog="attnchecker", description=__doc__)
    p.add_argument("--version", action="version", version=f"attnchecker {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="show extreme errors located and corrected")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    demo.add_argument(
        "--family", default="gpt2", choices=["bert", "roberta", "gpt2", "gpt_neo", "llama"]
    )
    demo.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
