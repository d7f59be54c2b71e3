"""The CLI's shape: every command group is a module with ``add_parser(sub)`` and its line of the
commands-by-task list, each command's help page is its handler's docstring, and ``plan`` writes
its plan and nothing else (the profiles it decides from are read, not rewritten)."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest

from attnchecker import cli
from attnchecker.adaptive.controller import load_plan
from attnchecker.adaptive.profile import (
    Cell,
    CostProfile,
    Estimate,
    OpCost,
    cost_path,
    vulnerability_path,
)
from attnchecker.cli.common import add_command

OPS = ("scores", "context")


@pytest.mark.parametrize("name", cli.GROUPS)
def test_every_group_is_a_module_with_add_parser_and_a_task(name):
    group = importlib.import_module(f"attnchecker.cli.{name}")
    task, commands = group.TASK  # its line of the commands by task: "measure errors", "a, b"
    sub = argparse.ArgumentParser().add_subparsers()
    group.add_parser(sub)
    assert sub.choices and set(sub.choices) <= {w.strip(",") for w in commands.split()}, task


def test_a_commands_help_page_is_its_handlers_docstring():
    def run(args: argparse.Namespace) -> int:
        """What it does,
        on two lines.

        outputs: a file,
        and another

        example: attnchecker thing --out x
        """
        return 0

    sub = argparse.ArgumentParser().add_subparsers()
    p = add_command(sub, "thing", run, "one line")
    assert p.description == "What it does, on two lines."
    assert p.epilog == "outputs: a file, and another\nexample: attnchecker thing --out x"
    assert p.parse_args([]).func is run
    bare = add_command(sub, "group", None, "subcommands only")
    assert bare.description is None and bare.epilog is None
    assert "func" not in vars(bare.parse_args([]))


def _campaign(tmp_path):
    """A hand-made campaign (its meta.json and trials) and the cost profile bench would write."""
    meta = {"config": {"layer": 0, "size": "tiny", "batch": 4, "seq_len": 32}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    rows = [
        {"family": "gpt2", "site": op, "layer": layer, "kind": "nan",
         "unprotected": {"outcome": "non_trainable"}, "protected": {"outcome": "masked"}}
        for op in OPS for layer in (0, 1) for _ in range(4)
    ]  # fmt: skip
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    CostProfile(
        "gpt2", {"layers": 2}, 0.01, Estimate(0.05, 0.02, 0.08), 10,
        tuple(OpCost(op, Estimate(0.1, 0.08, 0.12), 100) for op in OPS),
        tuple((layer, op, 1000) for layer in (0, 1) for op in OPS), step_macs=10_000,
    ).save(cost_path(tmp_path, "gpt2"))  # fmt: skip
    return tmp_path


def test_plan_writes_the_plan_and_nothing_else(tmp_path, capsys):
    camp = _campaign(tmp_path)
    before = sorted(p.name for p in camp.iterdir())
    argv = ["plan", "--campaign", str(camp), "--fault-rate", "1", "--per", "step",
            "--budget", "100%", "--kinds", "nan=1"]  # fmt: skip
    assert cli.main(argv) == 0
    assert sorted(p.name for p in camp.iterdir()) == sorted([*before, "plan.json"])
    assert not vulnerability_path(camp, "gpt2").exists()
    plan = json.loads((camp / "plan.json").read_text())
    assert plan["rate"] == {"value": 1.0, "per": "step", "kinds": {"nan": 1.0}}
    config = load_plan(camp / "plan.json")  # what train --plan protects with
    assert config.schedule and {op for _, op, _ in config.schedule} <= set(OPS)
    assert f"wrote {camp / 'plan.json'}" in capsys.readouterr().out


def test_plan_says_what_is_wrong_with_its_inputs(tmp_path, capsys):
    camp = _campaign(tmp_path)
    base = ["plan", "--campaign", str(camp), "--fault-rate", "1", "--budget", "5%"]
    assert cli.main([*base, "--kinds", "nan:1"]) == 2
    assert cli.main([*base, "--cost", str(tmp_path / "none.json")]) == 2
    assert cli.main([*base, "--family", "llama"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "--kinds is kind=probability" in err[0]
    assert "no cost profile at" in err[1] and "attnchecker bench --campaign" in err[1]
    assert "has no trials of 'llama'" in err[2]


def test_a_campaigns_profiles_are_written_by_the_library(tmp_path):
    from attnchecker.adaptive.profile import (
        VulnerabilityProfile,
        campaign_family,
        campaign_setup,
        write_vulnerability_profiles,
    )

    camp = _campaign(tmp_path)
    assert campaign_family(camp) == "gpt2"
    assert campaign_setup(camp) == {"size": "tiny", "batch": 4, "seq_len": 32}
    (path,) = write_vulnerability_profiles(camp)
    assert path == vulnerability_path(camp, "gpt2")
    vuln = VulnerabilityProfile.load(path)
    assert sum(c.trials for c in vuln.cells) == 16 and set(vuln.ops) == set(OPS)
    cell = Cell("scores", 0, "nan", 4, {"non_trainable": 4}, {"masked": 4})
    assert vuln.cell("scores", 0, "nan")[0].trials == cell.trials
