"""AttnCheckerCallback with a real Hugging Face Trainer on a tiny model."""

from __future__ import annotations

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
    assert (finding.step, finding.cause) == (2, "computation_fault")
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
