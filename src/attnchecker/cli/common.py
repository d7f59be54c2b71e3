"""What every command module shares: how a command is added (its help page is its handler's
docstring), the help formatter, and relaunching a command under torchrun."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import textwrap
from collections.abc import Callable

__all__ = ["HelpFormatter", "add_backend", "add_command", "needs_torchrun", "relaunch"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown; description and epilog wrapped line by line (their line breaks kept)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent + "  ")
            for line in text.splitlines()
        )


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    run: Callable[[argparse.Namespace], int] | None,
    summary: str,
    *,
    doc: str | None = None,
) -> argparse.ArgumentParser:
    """Add command ``name`` to ``sub``, run by ``run(args)`` (its exit status; None: a group
    whose subcommands run). ``summary`` is its line in the command list; its help page is
    ``doc``, by default ``run``'s docstring (as click does): the paragraphs that start with
    ``outputs:`` or ``example:`` are its epilog, a line each, the others its description."""
    about, epilog = [], []
    for paragraph in inspect.cleandoc(doc or (run.__doc__ if run else None) or "").split("\n\n"):
        if text := " ".join(paragraph.split()):
            (epilog if text.startswith(("outputs:", "example:")) else about).append(text)
    p = sub.add_parser(name, help=summary, description="\n".join(about) or None,
                       epilog="\n".join(epilog) or None, formatter_class=HelpFormatter)  # fmt: skip
    if run is not None:
        p.set_defaults(func=run)
    return p


def add_backend(
    p: argparse.ArgumentParser, help: str, choices: tuple[str, ...] | None = None
) -> None:
    """``--backend``: which engine runs protected attention (default ``auto``, as
    :class:`~attnchecker.ABFTConfig`'s: the SDPA route on CUDA, the checked eager math
    elsewhere; ``choices`` default :data:`attnchecker.attention.config.BACKENDS`)."""
    from attnchecker.attention.config import BACKENDS

    choices = choices or BACKENDS
    default = "auto" if "auto" in choices else "eager"
    p.add_argument("--backend", default=default, choices=choices, help=help)


def needs_torchrun(args: argparse.Namespace) -> bool:
    """``--nproc`` asks for processes and this is not one of them yet."""
    return args.nproc > 1 and "LOCAL_RANK" not in os.environ


def relaunch(args: argparse.Namespace) -> int:
    """Run this same command under torchrun with ``--nproc`` processes (gloo on CPU)."""
    import subprocess

    argv = list(args.argv)
    i = argv.index("--nproc")
    del argv[i : i + 2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(args.nproc), "-m", "attnchecker", *argv]
    return subprocess.call(cmd)
