"""Command line: ``attnchecker <command>``, one module per command group (``add_parser(sub,
formatter)`` and its handlers): parse, build one config, call the library, print."""

from __future__ import annotations

import argparse
import os
import sys

from attnchecker.errors import AttnCheckerError

__all__ = ["main"]


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown; description and epilog wrapped line by line (their line breaks kept)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return "\n".join(
            textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent + "  ")
            for line in text.splitlines()
        )


_DESCRIPTION = """\
attnchecker keeps transformer training correct when the hardware computes wrong
numbers: checksums that find and correct INF / NaN / near-INF errors in attention's
GEMMs (forward and backward), fault injection to measure what errors do, SDC
analysis and recovery."""
_BY_TASK = """commands by task:
  see it work          demo
  train                train (protected or not, under faults, with recovery)
  measure errors       campaign, report
  choose what to check bench, plan, validate
  silent corruption    sdc
"""


def _parser() -> argparse.ArgumentParser:
    from attnchecker import __version__

    p = argparse.ArgumentParser(
        prog="attnchecker", description=_DESCRIPTION, epilog=_BY_TASK,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--version", action="version", version=f"attnchecker {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = p.add_subparsers(dest="command", required=True)
    from attnchecker.cli import adaptive, campaign, demo, sdc, train

    for group in (demo, train, campaign, sdc, adaptive):
        group.add_parser(sub, _Help)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a command; bad input (a library error, a missing or malformed file, a bad value) is
    one line on stderr and exit status 2, without a traceback unless ``--debug``."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if getattr(args, "backend", "eager") != "eager":
            _kernels_here(args.backend)
        return int(args.func(args))
    except KeyboardInterrupt:
        print("attnchecker: interrupted", file=sys.stderr)
        return 130
    except (AttnCheckerError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"attnchecker: error: {_say(e)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _say(e: BaseException) -> str:
    """One line about a bad input."""
    import json

    if isinstance(e, FileNotFoundError):
        return f"no such file or directory: {e.filename}"
    if isinstance(e, IsADirectoryError):
        return f"a directory where a file was expected: {e.filename}"
    if isinstance(e, PermissionError):
        return f"permission denied: {e.filename}"
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _kernels_here(backend: str) -> None:
    """The fused kernels without CUDA run in Triton's interpreter, which must be chosen before
    the kernels are first imported; say so (it is slow: for trying things out and tests)."""
    import torch

    if (
        backend == "triton"
        and not torch.cuda.is_available()
        and "TRITON_INTERPRET" not in os.environ
    ):
        os.environ["TRITON_INTERPRET"] = "1"
        print("attnchecker: no CUDA device: the fused kernels run in Triton's interpreter (slow)")
