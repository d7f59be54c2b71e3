"""With ``ops`` that name no core check, the model's own attention runs untouched (issue 42
§9): the checked core (L x L scores, mask and softmax in memory, ~8 more passes) replaced the
model's SDPA call even when nothing checked it. Now only the projections are checked; a clean
step's loss and every gradient are the plain model's bitwise, the step makes no L x L tensor
the plain model does not, faults in the projections are still corrected, and a hook at a core
site (a fault placed there) brings the checked core back in, as ``ABFTConfig.ops`` asks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker import ABFTConfig, protect_
from attnchecker.attention.ops import OP_TABLE
from attnchecker.models.tiny import build

from .sdpa_models import VOCAB, T
from .sdpa_models import build as build_own

PROJECTIONS = ABFTConfig(ops=tuple(o.name for o in OP_TABLE if o.part == "projection"))
L = 24  # not the tiny models' hidden size (32) nor a head size: an L x L output is attention's


class _Squares(TorchDispatchMode):
    """Counts the ops whose output ends in an (n, n) matrix: scores, masks, probabilities."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.count = n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2:] == (self.n, self.n):
                self.count += 1
        return out


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "bart", "gpt_neo"])
def test_projection_checks_leave_the_models_own_attention_untouched(family, impl):
    if family == "gpt_neo" and impl == "sdpa":
        pytest.skip("GPT-Neo has no SDPA attention: its own is eager (its _attn)")
    base = build(family, layers=2, max_len=64)
    base.train()
    plain, protected = copy.deepcopy(base), copy.deepcopy(base)
    for m in (plain, protected):
        m.set_attn_implementation(impl)
    handle = protect_(protected, PROJECTIONS)
    ids = torch.randint(3, 100, (2, L), generator=torch.Generator().manual_seed(0))
    want, got = _step(plain, ids), _step(protected, ids)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    squares = []
    for m in (plain, protected):
        with _Squares(L) as sq:
            _step(m, ids)
        squares.append(sq.count)
    assert squares[1] == squares[0], squares  # the checked core would add ~8 per layer
    assert handle.drain() == []
    assert {v["core"] for v in handle.summary()["per_module"].values()} == {"own"}


def test_projection_faults_are_corrected_while_sdpa_runs_and_a_core_hook_brings_the_core():
    base = build("llama", layers=2, max_len=64)
    base.train()
    plain, protected = copy.deepcopy(base), copy.deepcopy(base)
    for m in (plain, protected):
        m.set_attn_implementation("sdpa")
    handle = protect_(protected, PROJECTIONS)
    ids = torch.randint(3, 100, (2, L), generator=torch.Generator().manual_seed(0))
    want = _step(plain, ids)

    def fault(site):
        def hook(c):
            if c.site == site and c.layer == 1:
                c.tensor[(0,) * (c.tensor.dim() - 1) + (3,)] = float("inf")

        return hook

    for site in ("q", "dx.out"):
        detach = handle.attach(fault(site), sites=(site,))
        with _Squares(L) as sq:
            got = _step(protected, ids)
        detach.remove()
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")]
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        assert max(float((got[1][n] - want[1][n]).abs().max()) for n in want[1]) <= 1e-5
        assert sq.count == 0, site  # SDPA's CPU flash kernel, no scores in memory
    # a hook at a core site needs the checked core: it runs (and its probabilities with it)
    detach = handle.attach(lambda c: None, sites=("scores",))
    core = handle.summary()["per_module"]
    with _Squares(L) as sq:
        _step(protected, ids)
    detach.remove()
    assert {v["core"] for v in core.values()} == {"checked"} and sq.count > 0
    assert {v["core"] for v in handle.summary()["per_module"].values()} == {"own"}


def test_a_model_of_ones_own_keeps_its_sdpa_call():
    """The SDPA route: protected with projection checks only, a nanoGPT look-alike's
    F.scaled_dot_product_attention runs as it called it (bitwise the plain model's step)."""
    import torch.nn.functional as F

    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))

    def step(model):
        logits = model(idx)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want = step(build_own("nanogpt"))
    model = build_own("nanogpt")
    handle = protect_(model, PROJECTIONS, example=(idx,))
    got = step(model)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert {v["core"] for v in handle.summary()["per_module"].values()} == {"own"}
    assert handle.drain() == []


def test_gpt_neo_runs_its_own_attn_method(monkeypatch):
    """GPT-Neo's patched ``_attn`` (it does not dispatch through transformers' interface)
    hands over to the class's own method when nothing needs the checked core, and keeps the
    core while a hook sits at a core site."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    calls = []
    own = GPTNeoSelfAttention._attn

    def spy(self, *args, **kwargs):
        calls.append(self)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(GPTNeoSelfAttention, "_attn", spy)
    model = build("gpt_neo", layers=2, max_len=64)
    handle = protect_(model, PROJECTIONS)
    ids = torch.randint(3, 100, (2, L), generator=torch.Generator().manual_seed(0))
    _step(model, ids)
    assert len(calls) == 2  # both layers, their own method
    detach = handle.attach(lambda c: None, sites=("scores",))
    _step(model, ids)
    detach.remove()
    assert len(calls) == 2  # the checked core ran instead
