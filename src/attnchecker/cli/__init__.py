"""Command line: ``attnchecker <command>``, one module per command group: its ``add_parser(sub)``
adds its commands (:func:`attnchecker.cli.common.add_command`), each run by a handler that
parses, builds one config, calls the library and prints; its ``TASK`` is its line of the
commands-by-task list. A new group is a module here and its name in :data:`GROUPS`; a new
command in a group touches that module only."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from attnchecker.errors import AttnCheckerError

__all__ = ["GROUPS", "main"]

# the command groups, in the order of the help (each a module of this package)
GROUPS = ("demo", "train", "campaign", "adaptive", "sdc")

_DESCRIPTION = """\
attnchecker keeps transformer training correct when the hardware computes wrong
numbers: checksums that find and correct INF / NaN / near-INF errors in attention's
GEMMs (forward and backward), fault injection to measure what errors do, SDC
analysis and recovery."""


def _parser() -> argparse.ArgumentParser:
    from attnchecker import __version__

    groups = [importlib.import_module(f"attnchecker.cli.{name}") for name in GROUPS]
    by_task = "\n".join(f"  {task:<20} {commands}" for task, commands in (g.TASK for g in groups))
    p = argparse.ArgumentParser(
        prog="attnchecker", description=_DESCRIPTION, epilog=f"commands by task:\n{by_task}\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--version", action="version", version=f"attnchecker {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = p.add_subparsers(dest="command", required=True)
    for group in groups:
        group.add_parser(sub)
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
