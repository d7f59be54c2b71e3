"""Bad input at the command line: one line on stderr naming what is wrong (and the valid values),
exit status 2, no traceback; ``--debug`` shows it. And ``python -m attnchecker`` is the command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnchecker import cli
from attnchecker.errors import ConfigError

PLAN = {"seed": 0, "faults": [{"step": 1, "site": "scores", "kind": "nan"}]}


def _plan(tmp_path, content) -> str:
    path = tmp_path / "plan.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _bad_fault(**changes):
    return {"seed": 0, "faults": [{**PLAN["faults"][0], **changes}]}


CASES = {
    "unknown kind": (lambda t: ["train", "--out", str(t / "r"), "--faults",
                                _plan(t, _bad_fault(kind="banana"))], "fault kind 'banana'"),
    "unknown pattern": (lambda t: ["train", "--out", str(t / "r"), "--faults",
                                   _plan(t, _bad_fault(pattern="3D"))], "choose from ['0D'"),
    "unknown site": (lambda t: ["train", "--out", str(t / "r"), "--faults",
                                _plan(t, _bad_fault(site="nowhere"))], "unknown site 'nowhere'"),
    "unknown key": (lambda t: ["train", "--out", str(t / "r"), "--faults",
                               _plan(t, _bad_fault(sight="q"))], "unknown keys ['sight']"),
    "malformed plan": (lambda t: ["train", "--out", str(t / "r"), "--faults",
                                  _plan(t, '{"seed": 0, "faults": [')], "must be JSON"),
    "missing plan": (lambda t: ["train", "--out", str(t / "r"), "--faults", str(t / "no.json")],
                     "no such file or directory"),
    "missing model config": (lambda t: ["train", "--out", str(t / "r"), "--model",
                                        str(t / "none.json")], "cannot read a transformers config"),
    "campaign site": (lambda t: ["campaign", "--out", str(t / "c"), "--sites", "nowhere"],
                      "unknown sites ['nowhere']"),
    "corrupt recording": (lambda t: ["sdc", "compare", _plan(t, "nope"), _plan(t, "nope")],
                          "not valid JSON"),
    "not a run directory": (lambda t: ["report", str(t)], "not a campaign, demo or training run"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_status_2(case, tmp_path, capsys):
    argv, expected = CASES[case]
    assert cli.main(argv(tmp_path)) == 2
    out = capsys.readouterr()
    lines = (out.err or out.out).strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert "Traceback" not in out.err + out.out


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ConfigError, match="banana"):
        cli.main(["--debug", "train", "--out", str(tmp_path / "r"), "--faults",
                  _plan(tmp_path, _bad_fault(kind="banana"))])  # fmt: skip


def test_python_dash_m_is_the_command():
    run = subprocess.run(
        [sys.executable, "-m", "attnchecker", "--help"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and "usage: attnchecker" in run.stdout


@pytest.mark.parametrize("command", ["demo", "campaign", "train", "sdc", "report"])
def test_every_command_explains_itself_with_an_example(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    assert f"example: attnchecker {command}" in text
    if command in ("demo", "campaign", "train"):
        assert "outputs:" in text


def test_the_top_level_help_says_what_it_does_and_lists_every_command_by_task(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "keeps transformer training correct" in text and "Thin:" not in text
    by_task = text.split("commands by task:")[1]
    listed = {w.strip(",") for line in by_task.splitlines() for w in line[23:].split()}
    sub = next(a for a in cli._parser()._actions if a.dest == "command")
    assert set(sub.choices) <= listed, set(sub.choices) - listed
