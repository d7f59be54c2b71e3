"""AttnCheckerCallback with a real Hugging Face Trainer on a tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from attnchecker import ABFTConfig, protect_
from attnchecker.inject import FaultPlan, Injector
from attnchecker.integrations import AttnCheckerCallback
from attnchecker.models.tiny import build


def _dataset(n: int = 8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (n, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class _Logs(TrainerCallback):
    """Runs after AttnCheckerCallback and keeps what it added to each log."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _trainer(model, tmp_path, callback):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=_dataset(), callbacks=[callback, _Logs()]
    )
    trainer.recorded = next(c for c in trainer.callback_handler.callbacks if isinstance(c, _Logs))
    return trainer


def test_trainer_protects_logs_and_unprotects(tmp_path):
    model = build("gpt2")
    cb = AttnCheckerCallback()
    trainer = _trainer(model, tmp_path, cb)
    trainer.train()
    logs = [h for h in trainer.recorded.logs if "attnchecker/detected" in h]
    assert len(logs) >= 4 and all(h["attnchecker/detected"] == 0 for h in logs)
    assert getattr(model, "_attnchecker_handle", None) is None  # removed at train end


def test_faults_are_corrected_under_the_trainer(tmp_path):
    ref, model = build("gpt2"), build("gpt2")
    _trainer(ref, tmp_path / "ref", AttnCheckerCallback()).train()
    protect_(model, ABFTConfig(policy="raise"))
    plan = FaultPlan.builder().at(2).site("scores", layer=1).kind("nan").pattern("1R").add().build()
    cb = AttnCheckerCallback()
    trainer = _trainer(model, tmp_path / "run", cb)
    with Injector(model, plan) as inj:
        trainer.train()
    assert len(inj.records) == 1
    assert [(e.op, e.action) for e in cb.events] == [("scores", "corrected")]
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5), n
    logs = [h for h in trainer.recorded.logs if "attnchecker/corrected" in h]
    assert logs[-1]["attnchecker/corrected"] == 1
    # diagnosed: a computation fault at step 2 on this rank, counted in the logs
    [finding] = cb.findings
    assert (finding.step, finding.cause) == (2, "fault")
    assert finding.verdict == "your hardware"
    assert "layer 1 scores" in finding.message
    assert logs[-1]["attnchecker/rank0/faults"] == 1


def test_skip_step_policy_drops_the_update(tmp_path):
    model = build("bert")
    protect_(model, ABFTConfig(policy="skip_step", max_rows=1))
    plan = (
        FaultPlan.builder()
        .at(1)
        .site("q", layer=0)
        .kind("nan")
        .pattern("2D", size=(4, 4))
        .add()
        .build()
    )
    cb = AttnCheckerCallback()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in _dataset()]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
        use_cpu=True,
        save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    with Injector(model, plan):
        trainer.train()
    assert cb.skipped_steps == 1  # by the guard, on the device (fused AdamW's found_inf)
    assert cb.guarded is not None and cb.guarded.fused
    assert "step" not in vars(cb.guarded.optimizer)  # the optimizer's step restored at the end
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# fp16: the Trainer steps through accelerate's GradScaler path, which re-sets the optimizer's
# step at every step. Accelerate ignores fp16 on the CPU (no scaler, no autocast), so there the
# test gives it what it builds on CUDA; GradScaler("cpu") runs the same code. A low initial
# scale keeps clean fp16 gradients of the tiny model from overflowing.
SCALE = 2.0**10
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]
OPTIMS = ["adamw_torch_fused", "adamw_torch"]  # found_inf in the kernel / the scaler's host check


def _fp16_trainer(model, tmp_path, callback, device, optim, steps=1):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, report_to=[],
        use_cpu=device == "cpu", save_strategy="no", seed=0, dataloader_num_workers=0,
        fp16=True, optim=optim,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[callback])
    trainer.accelerator.scaler = torch.amp.GradScaler(device, init_scale=SCALE)
    trainer.accelerator.native_amp = True  # autocast to fp16, unscale before clipping
    return trainer


def _params(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _finite_fault_once(handle):
    """+3 in the scores of three heads of layer 0, with max_heads=1: uncorrectable but finite,
    so the scaler sees no overflow and only the guard can skip the step; first forward only."""
    fired = []

    def hook(c):
        if c.site == "scores" and c.layer == 0 and not c.replay and not fired:
            c.tensor[:, :3, 2, 2] += 3.0
            fired.append(True)

    return handle.attach(hook)


@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("device", DEVICES)
def test_fp16_skip_step_policy_drops_the_update(tmp_path, device, optim):
    model = build("bert")
    handle = protect_(model, ABFTConfig(policy="skip_step", max_heads=1))
    _finite_fault_once(handle)
    cb = AttnCheckerCallback()
    trainer = _fp16_trainer(model, tmp_path, cb, device, optim)
    before = _params(model)
    trainer.train()
    assert any(e.action == "uncorrectable" for e in cb.events)
    assert cb.skipped_steps == 1
    assert trainer.accelerator.scaler.get_scale() == SCALE  # no overflow: the guard skipped it
    assert all(torch.equal(p, before[n]) for n, p in _params(model).items())
    assert "step" not in vars(cb.guarded.optimizer)  # the optimizer's step restored at the end


@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("device", DEVICES)
def test_fp16_overflow_is_skipped_under_the_guard(tmp_path, device, optim):
    model = build("bert")
    protect_(model, ABFTConfig(policy="skip_step"))
    weight = model.get_input_embeddings().weight
    weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3], device=g.device), torch.inf))
    cb = AttnCheckerCallback()
    trainer = _fp16_trainer(model, tmp_path, cb, device, optim)
    before = _params(model)
    trainer.train()
    assert trainer.accelerator.scaler.get_scale() == SCALE / 2  # backed off, as usual
    after = _params(model)
    assert all(torch.isfinite(p).all() and torch.equal(p, before[n]) for n, p in after.items())
    assert cb.skipped_steps == 0  # the scaler's skip, not the guard's


@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("device", DEVICES)
def test_fp16_guarded_steps_equal_unguarded_ones(tmp_path, device, optim):
    """Two clean fp16 steps with the guard (skip_step) and without it (warn): the same update."""
    ref, model = build("bert"), build("bert")
    protect_(ref, ABFTConfig(policy="warn"))
    protect_(model, ABFTConfig(policy="skip_step"))
    _fp16_trainer(ref, tmp_path / "ref", AttnCheckerCallback(), device, optim, steps=2).train()
    cb = AttnCheckerCallback()
    trainer = _fp16_trainer(model, tmp_path / "run", cb, device, optim, steps=2)
    trainer.train()
    assert cb.guarded is not None and cb.guarded.skipped is not None  # the guard took the steps
    assert cb.skipped_steps == 0 and trainer.accelerator.scaler.get_scale() == SCALE
    want = _params(ref)
    assert all(torch.equal(p, want[n]) for n, p in _params(model).items())
