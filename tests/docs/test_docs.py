"""The README and the reference pages under ``docs/``: they build strictly, the README stays one
screen per question, every command they show is the command line's, every link lands, and the
README's cost figures are in the files they cite. (Their Python examples run as tests of their
own: ``conftest.py``.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def test_the_docs_build_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing page or a docstring the API
    reference cannot render fails the run."""
    site = str(tmp_path / "site")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", site]
    out = subprocess.run(build, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("protect_") > 3


def test_the_readme_answers_in_its_first_screen():
    """About 200-300 lines; what it protects, what it costs on a GPU and how to start, first."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    first = "\n".join(lines[:50])
    assert "## Two commands" in first and "make demo" in first  # how to start
    assert "## What it costs" in first and "H200" in first  # what it costs on a GPU


def _shown_commands(text: str) -> list[tuple[str, bool]]:
    """The commands a page shows, each with whether it is whole: each line of its shell blocks
    (continuations joined, comments and optional brackets dropped, ``;`` / ``&&`` split; whole)
    and each inline ``attnchecker ...`` span (a command named in prose, its required arguments
    perhaps left out)."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang not in ("bash", "sh", "shell", ""):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0] if not line.startswith("#") else ""
            out += [(p.strip(), True) for p in re.split(r";|&&", line) if p.strip()]
    prose = FENCE.sub("", text)
    out += [(c, False) for c in re.findall(r"`(attnchecker [^`<]+)`", prose)]
    return [(re.sub(r"<[^>]+>", "x", c).replace("[", "").replace("]", ""), whole)
            for c, whole in out]  # fmt: skip


def _named(parser, words: list[str]) -> bool:
    """Whether ``words`` name a command (and its subcommands) and only options it has."""
    import argparse

    for i, w in enumerate(words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or w.startswith("-"):
            options = {o for a in parser._actions for o in a.option_strings}
            return all(x.split("=")[0] in options for x in words[i:] if x.startswith("--"))
        if w not in subs[0].choices:
            return False
        parser = subs[0].choices[w]
    return True


def test_every_command_shown_is_the_command_lines():
    """Every ``attnchecker`` command of a shell block parses (without running), and every one
    named in prose is a command with those options; every ``make`` target exists; every
    script run is in the repository."""
    import contextlib
    import io

    from attnchecker.cli import _parser

    parser = _parser()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    seen, bad = 0, []
    for page in PAGES:
        for cmd, whole in _shown_commands(page.read_text()):
            words = shlex.split(cmd)
            while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value cmd
                words = words[1:]
            if words[:3] == ["python", "-m", "attnchecker"]:
                words = ["attnchecker", *words[3:]]
            if not words:
                continue
            if words[0] == "attnchecker" and len(words) > 1:
                seen += 1
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        ok = parser.parse_args(words[1:]) if whole else _named(parser, words[1:])
                except SystemExit:
                    ok = False
                if not ok:
                    bad.append(f"{page.name}: `{cmd}`")
            else:
                unknown_target = not {w for w in words[1:] if "=" not in w} <= targets
                script = words[1] if words[0] == "python" and len(words) > 1 else ""
                if (words[0] == "make" and unknown_target) or (
                    script.endswith(".py") and not (ROOT / script).is_file()
                ):
                    bad.append(f"{page.name}: `{cmd}`")
    assert bad == []
    assert seen > 50


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs make it."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_link_of_the_readme_lands():
    """Each relative link is a file of the repository, and its anchor a heading there (the
    pages' own links are mkdocs' to check)."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", text)
    assert len(links) > 10
    for path, anchor in links:
        if path.startswith("http"):
            continue
        assert (ROOT / path).exists(), path
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path}#{anchor}"


def test_the_readmes_cost_figures_are_in_the_files_they_cite():
    """Each bold figure of the README's cost table is in the results file its row cites
    ("same file": the row above's): rerun the benchmark and the README follows, or fails."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## What it costs") :].split("\n\n")[2]
    cited, checked = None, 0
    for row in table.splitlines()[2:]:
        if m := re.search(r"\]\((benchmarks/results/[^)]+)\)", row):
            cited = (ROOT / m.group(1)).read_text()
        for figure in re.findall(r"[+-]\d+\.\d%", row.split("|")[2]):
            assert figure in cited, f"{figure} not in the file its row cites: {row}"
            checked += 1
    assert checked >= 5
