"""protect_ on PyTorch models outside transformers that call F.scaled_dot_product_attention
(attnchecker.models.sdpa): five layouts (nanoGPT, litgpt with GQA and RoPE, torchtitan with
a scale and K/V repeated by hand, timm's reshape(..., 3, H, hd), x-transformers' separate
Attend module with a boolean padding mask, GPT-NeoX's Q|K|V interleaved per head) and
PyTorch's nn.TransformerEncoder
(nn.MultiheadAttention, routed at F.multi_head_attention_forward). For each: the clean step
is the model's own within fp32 rounding (the checked core is eager math, SDPA's CPU kernel
sums in another order), a fault in every GEMM of the attention core, forward and backward, is
corrected in the same step, and the compiled model is one graph pair with no recompile.
Attention by hand is refused by name."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from attnchecker import ABFTConfig, protect_, unprotect_
from attnchecker.attention.ops import CORE_GRAD_OPS
from attnchecker.errors import UnsupportedModelError
from attnchecker.models.sdpa import sdpa_modules

from .sdpa_models import MODELS, VOCAB, T, TimmAttention, build

IDX = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
CORE_SITES = ("scores", "probs", "context", *CORE_GRAD_OPS)
TOL = {"rtol": 1e-5, "atol": 1e-6}  # the eager core against SDPA's CPU kernel, fp32


def _step(model, run=None):
    model.zero_grad()
    logits = (model if run is None else run)(IDX)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), IDX[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _close(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], **TOL)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _inf(call) -> None:
    call.tensor.view(-1)[5] = math.inf


@pytest.mark.parametrize("layout", sorted(MODELS))
def test_every_core_gemm_fault_is_corrected_in_each_layout(layout):
    want = _step(build(layout))
    model = build(layout)
    handle = protect_(model)
    assert len(handle.modules) == 2  # one attention module per block
    _close(_step(model), want)  # clean: the model's own step
    assert handle.drain() == []
    for site in CORE_SITES:
        detach = handle.attach(_inf, sites=(site,), modules=(handle.modules[0],))
        got = _step(model)
        detach.remove()
        _close(got, want)
        events = handle.drain()
        assert [(e.module, e.op, e.action) for e in events] == [
            (handle.modules[0], site, "corrected")
        ], site
    unprotect_(model)
    assert not any("forward" in vars(m) for m in model.modules())


PROJECTION_SITES = ("q", "k", "v", "out", "dx.q", "dw.q", "dx.out", "dw.out")
PROJECTIONS = {  # what the traced forward finds: each layer and the sites its output holds
    "nanogpt": {"c_attn": ("q", "k", "v"), "c_proj": ("out",)},
    "litgpt": {"qkv": ("q", "k", "v"), "proj": ("out",)},
    "torchtitan": {"wq": ("q",), "wk": ("k",), "wv": ("v",), "wo": ("out",)},
    "timm": {"qkv": ("q", "k", "v"), "proj": ("out",)},
    "x_transformers": {"to_q": ("q",), "to_k": ("k",), "to_v": ("v",), "to_out": ("out",)},
    "neox": {"query_key_value": ("q", "k", "v"), "dense": ("out",)},
}


def _inf_row(call) -> None:  # a projection's site is a column slice: index, never view
    call.tensor[(0,) * (call.tensor.dim() - 1) + (5,)] = math.inf


@pytest.mark.parametrize("layout", sorted(PROJECTIONS))
def test_a_traced_forward_finds_the_projections_and_their_faults_are_corrected(layout):
    """protect_(model, example=...): the projections of each SDPA call found through the
    autograd graph (fused Q | K | V split contiguously, GQA widths, RoPE in between, the
    output projection in the parent module) and checked as the families' are."""
    fresh = build(layout)
    block = sdpa_modules(fresh, (IDX,)).sdpa[0]
    parent = fresh.get_submodule(block.removesuffix(".attend"))  # x-transformers: Attend's
    names = {id(m): n for n, m in parent.named_children()}
    found = {names[id(p.module)]: p.sites for p in sdpa_modules(fresh, (IDX,)).projections[block]}
    assert found == PROJECTIONS[layout]
    want = _step(build(layout))
    model = build(layout)
    handle = protect_(model, example=(IDX,))
    _close(_step(model), want)
    assert handle.drain() == []
    for site in PROJECTION_SITES:
        detach = handle.attach(_inf_row, sites=(site,), modules=(block,))
        got = _step(model)
        detach.remove()
        _close(got, want)
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")], site


def test_an_example_input_finds_the_same_modules_as_the_sources():
    by_source = protect_(build("x_transformers")).modules
    by_forward = protect_(build("x_transformers"), example=(IDX,)).modules
    assert by_source == by_forward == ["h.0.attn.attend", "h.1.attn.attend"]


def test_all_linear_adds_every_linear_layer_projections_included():
    model = build("nanogpt")
    handle = protect_(model, ABFTConfig(scope="all_linear"))
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(handle.modules) == sorted(["h.0.attn", "h.1.attn", *linears])
    want = _step(build("nanogpt"))
    detach = handle.attach(_inf, sites=("y",), modules=("h.0.attn.c_attn",))
    got = _step(model)
    detach.remove()
    _close(got, want)
    assert [(e.module, e.op) for e in handle.drain()] == [("h.0.attn.c_attn", "y")]


@pytest.mark.parametrize(
    ("layout", "projections"),
    [("nanogpt", False), pytest.param("litgpt", True, marks=pytest.mark.slow)],
)  # the core alone compiles in ~20 s on 2 cores, with the projections ~50 s, a fault's hook more
def test_compiled_fullgraph_without_recompiles(layout, projections):
    """fullgraph=True (the core checked; in the slow set the projections too, and a fault): the
    mode is traced into the graph; clean steps compile nothing more (an attached fault hook is
    traced in: one recompilation, as for the families)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build(layout)
    handle = protect_(model, example=(IDX,) if projections else None)
    run = torch.compile(model, fullgraph=True)
    want = _step(build(layout))
    frames = []
    for _ in range(3):
        _close(_step(model, run), want)
        frames.append(counters["frames"]["total"])
    assert frames[1:] == frames[:1] * 2, f"recompiled: {frames}"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert handle.drain() == []
    if projections:  # and a fault, in the slow set
        detach = handle.attach(_inf, sites=("scores",), modules=("h.1.attn",))
        _close(_step(model, run), want)
        detach.remove()
        assert [(e.op, e.action) for e in handle.drain()] == [("scores", "corrected")]
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "layout",
    [m if m == "litgpt" else pytest.param(m, marks=pytest.mark.slow) for m in sorted(MODELS)],
)  # ~8 s each: the default run takes GQA + RoPE, the slow set every layout
def test_no_false_alarm_over_500_clean_training_steps(layout):
    """AdamW on a repeating set of random-token batches, every check on (the projections found
    by a traced forward, the core, forward and backward): no alarm, and the loss falls."""
    model = build(layout)
    handle = protect_(model, example=(IDX,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, VOCAB, (8, 4, T), generator=g)
    first = last = None
    for step in range(500):
        idx = data[step % 8]
        logits = model(idx)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = float(loss.detach()) if first is None else first
        last = float(loss.detach())
    assert handle.drain() == []
    assert last < first  # it trained


def test_attention_by_hand_is_refused_by_name():
    model = build("timm", fused=False)
    with pytest.raises(UnsupportedModelError, match=r"by hand .* h\.0\.attn, h\.1\.attn"):
        protect_(model, example=(IDX,))


def test_a_module_found_by_its_source_that_calls_no_sdpa_is_warned_about():
    model = build("timm", fused=False)  # its class names SDPA; this instance never calls it
    assert isinstance(model.h[0].attn, TimmAttention)
    protect_(model)
    with pytest.warns(RuntimeWarning, match="NOT checked"):
        model(IDX)


def test_multihead_attention_as_pytorch_computes_it_weights_and_padding_included():
    """nn.MultiheadAttention called directly (need_weights=True, the default: averaged weights),
    with a key padding mask (True masks out) and batch_first; its out_proj is checked with
    all_linear (the in-projection is a Parameter, in_proj_weight: not a linear layer)."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 8, 32)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[:, -2:] = True
    want = mha(x, x, x, key_padding_mask=pad)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x, key_padding_mask=pad)

    model = Wrapper()
    handle = protect_(model, ABFTConfig(scope="all_linear"))
    assert handle.modules == ["attn", "attn.out_proj"]
    got = model(x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    detach = handle.attach(_inf, sites=("y",), modules=("attn.out_proj",))
    torch.testing.assert_close(model(x)[0], want[0], **TOL)
    detach.remove()
    assert [(e.module, e.action) for e in handle.drain()] == [("attn.out_proj", "corrected")]


def test_a_model_without_attention_is_refused():
    with pytest.raises(UnsupportedModelError, match="calls no scaled_dot_product_attention"):
        protect_(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)))


class _FlexAttention(torch.nn.Module):
    def forward(self, q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v)


def test_flex_attention_is_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _FlexAttention())
    with pytest.raises(UnsupportedModelError, match=r"1 \(flex_attention\)"):
        protect_(model)


@pytest.mark.parametrize(
    ("layout", "sites"),
    [
        ("nanogpt", ("s", "dq")),  # strided slices of a fused Q|K|V (the dQ overrun it found)
        *(
            pytest.param(m, ("s", "pv", "st", "dq"), marks=pytest.mark.slow)
            for m in ("nanogpt", "litgpt", "x_transformers", "timm", "torchtitan")
        ),
    ],
)  # fmt: skip  ~3 s a step in the interpreter
def test_the_fused_kernels_run_the_sdpa_calls_and_correct_their_faults(layout, sites):
    """backend="triton" (the interpreter on a CPU): each SDPA call runs the checked flash
    kernels (causal, GQA, a key padding mask), the step equals the model's own, and a NaN in
    a GEMM of each kernel (S, P V, the backward's S^T, dQ) is corrected: the step is bitwise
    the clean fused step."""
    from attnchecker.kernels import available
    from attnchecker.kernels.flash import KernelFault

    if not available():
        pytest.skip("needs triton (CUDA or the interpreter)")
    want = _step(build(layout))
    model = build(layout)
    handle = protect_(model, ABFTConfig(backend="triton"), example=(IDX,))
    clean = _step(model)
    _close(clean, want)
    state = handle.state(handle.modules[0])
    assert state.coverage.engine == "triton" and not state.coverage.fallbacks
    assert handle.drain() == []
    for site in sites:
        state.kernel_fault = KernelFault(site, 0, 1, 5, 3, math.nan)
        got = _step(model)
        state.kernel_fault = None
        assert torch.equal(got[0], clean[0]) and all(
            torch.equal(a, b) for a, b in zip(got[1], clean[1], strict=True)
        ), site
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")], site


def test_an_sdpa_mask_the_kernels_do_not_take_runs_the_eager_core_and_says_so():
    """A float attn_mask (an ALiBi-like bias): the call runs the checked eager core, and the
    module's summary names why."""
    from attnchecker.kernels import available

    if not available():
        pytest.skip("needs triton (CUDA or the interpreter)")

    class Biased(torch.nn.Module):
        def forward(self, q, k, v):
            bias = -torch.arange(q.shape[-2], dtype=q.dtype).abs()[None, None, None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    model = Biased()
    q, k, v = (
        torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    want = model(q, k, v)
    handle = protect_(model, ABFTConfig(backend="triton"))
    torch.testing.assert_close(model(q, k, v), want, **TOL)
    assert "an additive float attn_mask" in " ".join(handle.state("").coverage.fallbacks)


def test_strict_false_protects_the_sdpa_calls_and_names_the_rest():
    """One block with SDPA, one with attention by hand: refused by default; with strict=False
    the SDPA block is protected (a fault corrected) and the other is named in a warning and in
    summary()["attention"]."""
    torch.manual_seed(0)
    model = build("timm")
    model.h[1].attn.fused = False  # attention by hand in block 1
    with pytest.raises(UnsupportedModelError, match=r"h\.1\.attn.*strict=False"):
        protect_(model, example=(IDX,))
    with pytest.warns(RuntimeWarning, match=r"by hand .* h\.1\.attn;.*NOT checked"):
        handle = protect_(model, ABFTConfig(strict=False), example=(IDX,))
    assert handle.modules == ["h.0.attn"]
    assert "h.1.attn" in handle.summary()["attention"]
    detach = handle.attach(_inf, sites=("scores",), modules=("h.0.attn",))
    _step(model)
    detach.remove()
    assert [(e.op, e.action) for e in handle.drain()] == [("scores", "corrected")]
