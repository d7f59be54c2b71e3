"""protect_ on PyTorch models outside transformers that call F.scaled_dot_product_attention
(attnchecker.models.sdpa): eight layouts (nanoGPT, litgpt with GQA and RoPE, torchtitan with
a scale and K/V repeated by hand, timm's reshape(..., 3, H, hd), x-transformers' separate
Attend module with a boolean padding mask, GPT-NeoX's Q|K|V interleaved per head, Megatron-LM's
linear_qkv interleaved per KV group with GQA and RoPE, timm's ParallelScalingBlock whose in_proj
makes the MLP's input and Q|K|V) and PyTorch's nn.TransformerEncoder (nn.MultiheadAttention,
routed at F.multi_head_attention_forward, its in_proj_weight checked as a projection). For
each: the clean step is the model's own within fp32 rounding (the checked core is eager math,
SDPA's CPU kernel sums in another order), a fault in every GEMM of the attention core and of
its projections, forward and backward, is corrected in the same step, and the compiled model
is one graph pair with no recompile. Attention by hand is refused by name."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from attnchecker import ABFTConfig, protect_, unprotect_
from attnchecker.attention.ops import CORE_GRAD_OPS
from attnchecker.errors import UnsupportedModelError
from attnchecker.models.sdpa import sdpa_modules

from .helpers import lm_step
from .sdpa_models import MODELS, VOCAB, T, TimmAttention, build

IDX = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
CORE_SITES = ("scores", "probs", "context", *CORE_GRAD_OPS)
TOL = {"rtol": 1e-5, "atol": 1e-6}  # the eager core against SDPA's CPU kernel, fp32


def _step(model, run=None):
    return lm_step(model, IDX, run)


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
    handle = protect_(model)  # found at the first forward, which runs checked
    _close(_step(model), want)  # clean: the model's own step
    assert len(handle.modules) == 2  # one attention module per block
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
    "megatron": {"linear_qkv": ("q", "k", "v"), "linear_proj": ("out",)},  # per KV group
    "timm_parallel": {"in_proj": ("q", "k", "v"), "attn_out_proj": ("out",)},  # after the MLP's
    "torch_encoder": {"in_proj_weight": ("q", "k", "v"), "out_proj": ("out",)},  # a Parameter
}


def _inf_row(call) -> None:  # a projection's site is a column slice: index, never view
    call.tensor[(0,) * (call.tensor.dim() - 1) + (5,)] = math.inf


@pytest.mark.parametrize("example", [True, False], ids=["example", "first_forward"])
@pytest.mark.parametrize("layout", sorted(PROJECTIONS))
def test_a_traced_forward_finds_the_projections_and_their_faults_are_corrected(layout, example):
    """protect_(model, example=...), or protect_(model) and its first forward: the
    projections of each SDPA call found through the autograd graph (fused Q | K | V split
    contiguously, at an offset after the MLP's input, or interleaved per head or per KV
    group; GQA widths, RoPE and norms in between, the output projection in the parent module;
    nn.MultiheadAttention's in_proj_weight) and checked as the families' are: every op of the
    default config checked, a fault in each projection GEMM corrected with the loss and every
    gradient equal to the fault-free step."""
    fresh = build(layout)
    block = sdpa_modules(fresh, (IDX,)).sdpa[0]
    parent = fresh.get_submodule(block.removesuffix(".attend"))  # x-transformers: Attend's
    names = {id(m): n for n, m in parent.named_children()}
    found = {
        p.params[0] if p.params else names[id(p.module)]: p.sites
        for p in sdpa_modules(fresh, (IDX,)).projections[block]
    }
    assert found == PROJECTIONS[layout]
    want = _step(build(layout))
    model = build(layout)
    handle = protect_(model, example=(IDX,) if example else None)
    _close(_step(model), want)
    assert handle.summary()["per_module"][block]["unchecked"] == {}
    assert handle.drain() == []
    for site in PROJECTION_SITES:
        detach = handle.attach(_inf_row, sites=(site,), modules=(block,))
        got = _step(model)
        detach.remove()
        _close(got, want)
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")], site


def _sites_of(layout, y):
    """The (Q, K, V) outputs of fused projection output y (B, L, N) as the layout's own code
    reads them, each (B, L, heads * hd) in head order."""
    B, L, _ = y.shape
    hd = 8
    if layout == "megatron":  # per KV group g: [q heads of g | k_g | v_g]
        g = y.view(B, L, 2, 4, hd)
        return g[..., :2, :].reshape(B, L, -1), g[..., 2, :].flatten(-2), g[..., 3, :].flatten(-2)
    if layout == "neox":  # per head h: [q_h | k_h | v_h]
        return tuple(y.view(B, L, 4, 3, hd)[..., i, :].flatten(-2) for i in range(3))
    return tuple(y[..., 128:].split(32, -1))  # timm_parallel: [MLP input | Q | K | V]


@pytest.mark.parametrize("layout", ["megatron", "neox", "timm_parallel"])
def test_the_sites_of_a_fused_projection_are_its_layouts_q_k_and_v(layout):
    """What each site shows (and what a fault there edits) is Q, K or V as the model's own code
    reads them from the fused output: strided per KV group or per head, or after the MLP's
    input features."""
    model = build(layout)
    handle = protect_(model, example=(IDX,))
    block = handle.modules[0]
    name = next(n for n, sites in PROJECTIONS[layout].items() if sites == ("q", "k", "v"))
    fused = model.get_submodule(f"{block}.{name}")
    seen, outs = {}, []
    detach = handle.attach(
        lambda call: seen.setdefault(call.site, call.tensor.clone()), sites=("q", "k", "v"),
        modules=(block,),
    )  # fmt: skip
    hook = fused.register_forward_hook(lambda m, a, y: outs.append(y.detach().clone()))
    model(IDX)
    detach.remove()
    hook.remove()
    want = _sites_of(layout, outs[0])
    for site, w in zip("qkv", want, strict=True):
        assert torch.equal(seen[site], w), site


def test_a_fault_in_the_mlp_features_of_a_parallel_block_in_proj_is_corrected():
    """timm's ParallelScalingBlock: the in_proj GEMM makes the MLP's input and Q | K | V at
    once; a fault in the MLP's part (no site of its own) is caught by the same check, counted
    for ``q`` (the GEMM's first site, as its backward's dx.q / dw.q), and corrected."""
    want = _step(build("timm_parallel"))
    model = build("timm_parallel")
    handle = protect_(model, example=(IDX,))

    def fault(module, args, y):
        y.data[1, 3, 17] = math.inf  # an MLP input feature (the first 128 outputs)

    hook = model.h[1].in_proj.register_forward_hook(fault, prepend=True)  # before the check
    got = _step(model)
    hook.remove()
    _close(got, want)
    assert [(e.module, e.op, e.action) for e in handle.drain()] == [("h.1", "q", "corrected")]


def test_the_first_forward_finds_what_an_example_finds():
    """Without example=, the first forward's trace finds the same modules and projections as
    a trace on an example at protect_: one model, one answer."""
    model = build("x_transformers")
    handle = protect_(model)
    model(IDX)
    by_example = protect_(build("x_transformers"), example=(IDX,))
    assert handle.modules == by_example.modules == ["h.0.attn.attend", "h.1.attn.attend"]
    assert handle.summary()["per_module"] == by_example.summary()["per_module"]


def test_all_linear_adds_every_linear_layer_outside_the_projections():
    """scope="all_linear" without example=: the projections found at the first forward are
    checked as projections (q, k, v, out, dx.*, dw.*), every other linear layer as one (y, dx,
    dw)."""
    model = build("nanogpt")
    handle = protect_(model, ABFTConfig(scope="all_linear"))
    want = _step(build("nanogpt"))
    _close(_step(model), want)
    projections = {"c_attn", "c_proj"}
    linears = [
        n for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] not in projections
    ]  # fmt: skip
    assert sorted(handle.modules) == sorted(["h.0.attn", "h.1.attn", *linears])
    for site, module in (("y", "h.0.fc"), ("q", "h.0.attn"), ("dw", "lm_head")):
        detach = handle.attach(_inf_row, sites=(site,), modules=(module,))
        got = _step(model)
        detach.remove()
        _close(got, want)
        assert [(e.module, e.op) for e in handle.drain()] == [(module, site)]


@pytest.mark.slow  # with the projections ~50 s each on 2 cores, a fault's hook more
@pytest.mark.parametrize(
    "layout", ["nanogpt", "litgpt", "torch_encoder", "megatron", "timm_parallel"]
)
def test_compiled_fullgraph_without_recompiles(layout):
    """fullgraph=True with example= (the core and the projections checked, the rows of
    nn.MultiheadAttention's in_proj_weight among them, and a fault): the mode is traced into
    the graph; clean steps compile nothing more (an attached fault hook is traced in: one
    recompilation, as for the families)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build(layout)
    handle = protect_(model, example=(IDX,))
    run = torch.compile(model, fullgraph=True)
    want = _step(build(layout))
    frames = []
    for _ in range(3):
        _close(_step(model, run), want)
        frames.append(counters["frames"]["total"])
    assert frames[1:] == frames[:1] * 2, f"recompiled: {frames}"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert handle.drain() == []
    detach = handle.attach(_inf, sites=("scores",), modules=(handle.modules[1],))
    _close(_step(model, run), want)
    detach.remove()
    assert [(e.op, e.action) for e in handle.drain()] == [("scores", "corrected")]
    torch._dynamo.reset()


@pytest.mark.slow  # 60 s
def test_compiled_after_protect_without_example_discovers_once_then_compiles_nothing_more():
    """torch.compile(model, fullgraph=True) after protect_(model): the first call runs
    discovery outside the compiled region (eager, once) and compiles the checked step; the
    second compiles once more (the clock's tick hook, installed during the first call, joins
    the graph); later steps compile nothing, break no graph, and a fault is corrected in the
    compiled step (the core's checks only: ~40 s on 2 cores)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build("nanogpt")
    handle = protect_(model, ABFTConfig(ops=CORE_SITES))
    run = torch.compile(model, fullgraph=True)
    want = _step(build("nanogpt"))
    graphs = []
    for _ in range(4):
        _close(_step(model, run), want)
        graphs.append(counters["stats"]["unique_graphs"])
    assert handle.modules == ["h.0.attn", "h.1.attn"]
    assert graphs == [graphs[0]] + [graphs[0] + 1] * 3, graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
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


def test_a_module_found_by_its_source_computing_attention_by_hand_is_refused_at_first_forward():
    """Its class names SDPA; this instance computes attention by hand. strict=True: its first
    forward raises what example= raises at protect_, word for word, and leaves the model as
    it was (the next forward is the model's own)."""
    model = build("timm", fused=False)
    assert isinstance(model.h[0].attn, TimmAttention)
    with pytest.raises(UnsupportedModelError) as at_protect:
        protect_(build("timm", fused=False), example=(IDX,))
    want = model(IDX)
    handle = protect_(model)
    assert handle.pending and handle.summary()["per_module"].keys() == {"h.0.attn", "h.1.attn"}
    with pytest.raises(UnsupportedModelError) as at_forward:
        model(IDX)
    assert str(at_forward.value) == str(at_protect.value)
    assert "by hand" in str(at_forward.value) and "h.0.attn, h.1.attn" in str(at_forward.value)
    assert not handle.pending and handle.modules == []
    torch.testing.assert_close(model(IDX), want, rtol=0, atol=0)
    assert not any(m._forward_pre_hooks or "forward" in vars(m) for m in model.modules())
    protect_(model, example=None)  # unprotected: it can be protected again


def test_a_module_that_leaves_sdpa_after_the_first_forward_is_warned_about_and_named():
    """A code path the traced forward did not take (SDPA on the first forward, by hand later):
    a warning once, and summary() names the core's ops as unchecked."""
    model = build("timm")
    handle = protect_(model)
    model(IDX)
    model.h[0].attn.fused = False
    with pytest.warns(RuntimeWarning, match="NOT checked"):
        model(IDX)
    unchecked = handle.summary()["per_module"]["h.0.attn"]["unchecked"]
    assert set(unchecked) == {"scores", "probs", "context", *CORE_GRAD_OPS}
    assert all("without calling scaled_dot_product_attention" in w for w in unchecked.values())
    assert handle.summary()["per_module"]["h.1.attn"]["unchecked"] == {}


def test_multihead_attention_as_pytorch_computes_it_weights_and_padding_included():
    """nn.MultiheadAttention called directly (need_weights=True, the default: averaged weights),
    with a key padding mask (True masks out) and batch_first; found at its first forward (no
    example=): its in-projection (in_proj_weight, a Parameter) and out_proj checked as
    projections."""
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
    got = model(x)
    assert handle.modules == ["attn"]
    assert handle.summary()["per_module"]["attn"]["unchecked"] == {}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    for site in ("q", "out"):
        detach = handle.attach(_inf_row, sites=(site,), modules=("attn",))
        torch.testing.assert_close(model(x)[0], want[0], **TOL)
        detach.remove()
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")]


class _CrossAttention(torch.nn.Module):
    """nn.MultiheadAttention over a memory: key is value (``split="q|kv"``, as
    nn.TransformerDecoderLayer's multihead_attn) or three inputs (``"q|k|v"``)."""

    def __init__(self, split: str) -> None:
        super().__init__()
        self.split = split
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x, mem):
        value = mem if self.split == "q|kv" else mem.flip(1)
        return self.attn(x, mem, value, need_weights=False)[0]


@pytest.mark.parametrize("split", ["q|kv", "q|k|v"])
def test_multihead_attention_in_projection_over_a_memory_is_checked_per_gemm(split):
    """An nn.MultiheadAttention whose key and query differ: its in-projection is two GEMMs of
    in_proj_weight's rows (Q; K | V) or three, each checked as a projection of its own input
    (sites q, k, v; dx / dw of each GEMM under its first site) and a fault in each corrected:
    the loss and every gradient equal PyTorch's own."""
    g = torch.Generator().manual_seed(3)
    x, mem = (torch.randn(2, n, 32, generator=g).requires_grad_() for n in (8, 6))  # dX too

    def step(model):
        model.zero_grad()
        x.grad = mem.grad = None
        loss = model(x, mem).square().sum()
        loss.backward()
        return loss.detach(), [t.grad.clone() for t in (*model.parameters(), x, mem)]

    torch.manual_seed(0)
    want = step(_CrossAttention(split))
    torch.manual_seed(0)
    model = _CrossAttention(split)
    specs = sdpa_modules(model, (x, mem)).projections["attn"]
    assert ["".join(p.sites) for p in specs] == [*split.split("|"), "out"]
    handle = protect_(model, example=(x, mem))
    _close(step(model), want)
    assert handle.drain() == []
    gemms = [s[0] for s in split.split("|")]  # each GEMM's backward: under its first site
    sites = ("q", "k", "v", "out", *(f"{g}.{s}" for s in (*gemms, "out") for g in ("dx", "dw")))
    for site in sites:
        detach = handle.attach(_inf_row, sites=(site,), modules=("attn",))
        got = step(model)
        detach.remove()
        _close(got, want)
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")], site


def test_a_model_that_is_itself_the_sdpa_caller_needs_an_example():
    """protect_ routes SDPA from the caller's forward, which the model's first call has
    entered before a pre-hook can run: refused at protect_, saying to pass example=."""

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    with pytest.raises(UnsupportedModelError, match=r"Attention itself.*pass example="):
        protect_(Attention())
    q = torch.randn(1, 2, 8, 4)
    handle = protect_(Attention(), example=(q, q, q))
    assert handle.modules == [""]


def test_a_model_without_attention_is_refused():
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    with pytest.raises(UnsupportedModelError, match="calls no scaled_dot_product_attention"):
        protect_(model, example=(IDX,))
    protect_(model)
    with pytest.raises(UnsupportedModelError, match="calls no scaled_dot_product_attention"):
        model(IDX)


class _Flex(torch.nn.Module):
    """Flex attention on its Q, K and V; its source also names SDPA, which it never calls."""

    def __init__(self, flex: bool = True) -> None:
        super().__init__()
        self.flex, self.qkv = flex, torch.nn.Linear(8, 24)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.flex:
            return flex_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("example", [True, False])
def test_flex_attention_seen_running_is_refused_by_name(example):
    """Refused because it runs (its CPU backward does not exist: the traced forward fails
    after it ran, and the refusal names it), at protect_ with example=, else at the first
    forward."""
    x = torch.randn(2, 8, 8)
    model = torch.nn.Sequential(_Flex())
    where = r"in 0 \(flex_attention\)"
    if example:
        with pytest.raises(UnsupportedModelError, match=where):
            protect_(model, example=(x,))
    else:
        protect_(model)
        with pytest.raises(UnsupportedModelError, match=where):
            model(x)


def test_a_module_that_names_flex_attention_and_runs_sdpa_is_protected():
    """The source names flex_attention (a branch not taken): what runs decides."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Flex(flex=False))
    x = torch.randn(2, 8, 8)
    want = model(x)
    handle = protect_(model)
    torch.testing.assert_close(model(x), want, **TOL)
    assert handle.modules == ["0"] and handle.summary()["attention"] is None
    unchecked = handle.summary()["per_module"]["0"]["unchecked"]  # it has no out projection
    assert unchecked.keys() == {"out", "dx.out", "dw.out"}
    assert all(why.startswith("no output projection") for why in unchecked.values())


@pytest.mark.parametrize(
    ("layout", "sites"),
    [
        ("nanogpt", ("s", "dq")),  # strided slices of a fused Q|K|V (the dQ overrun it found)
        *(
            pytest.param(m, ("s", "pv", "st", "dq"), marks=pytest.mark.slow)
            for m in (
                "nanogpt",
                "litgpt",
                "x_transformers",
                "timm",
                "torchtitan",
                "megatron",
                "timm_parallel",
            )
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
    assert state.coverage.engine_name == "triton" and not state.coverage.fallbacks
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
    handle = protect_(model, ABFTConfig(backend="triton"), example=(q, k, v))
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


_HIDDEN = {}  # flex attention kept where no recorder looks (not a global, a class or its home)


class _HiddenFlex(torch.nn.Module):
    """Its source names flex_attention; the function it calls hides in a dict."""

    def forward(self, q):
        return _HIDDEN["attend"](q, q, q)


def test_a_module_naming_flex_attention_that_runs_no_attention_seen_is_named():
    """What the recorders cannot see is not refused (nothing was seen running) and not left
    silent: a module whose source names flex_attention, that ran, and in which neither SDPA nor
    flex attention was seen, is named in a warning and in summary()["attention"]."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sdpa, self.other = _Flex(flex=False), _HiddenFlex()

        def forward(self, x):
            y = self.sdpa(x)
            return y + self.other(y)

    _HIDDEN["attend"] = lambda q, k, v: v.mean(-2, keepdim=True).expand_as(q)  # unseen
    x = torch.randn(2, 8, 8)
    model = Model()
    handle = protect_(model, ABFTConfig(ops=CORE_SITES))
    with pytest.warns(RuntimeWarning, match=r"other \(flex_attention\) name an attention"):
        model(x)
    assert handle.modules == ["sdpa"] and "other (flex_attention)" in handle.summary()["attention"]


def test_arguments_the_checked_core_does_not_implement_are_refused_by_name():
    """The checked core stands in for SDPA's call: arguments it does not implement (a mask
    with is_causal, which torch 2.13's CPU SDPA applies together although its documentation
    calls it an error; query heads not a multiple of key heads; operands that are not 4-D)
    raise UnsupportedModelError naming the module, never a silently different result (the
    core would drop the mask for the causal one)."""
    from attnchecker.models.sdpa import checked_sdpa

    model = build("nanogpt")
    protect_(model, example=(torch.randint(0, VOCAB, (2, T)),))
    attn = next(m for m in model.modules() if type(m).__name__ == "NanoGPTAttention")
    q, k, v = torch.randn(3, 2, 4, T, 8).unbind(0)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    with pytest.raises(UnsupportedModelError, match="both attn_mask and is_causal"):
        checked_sdpa(attn, q, k, v, attn_mask=mask, is_causal=True)
    with pytest.raises(UnsupportedModelError, match=r"4 query heads over 3 key heads"):
        checked_sdpa(attn, q, k[:, :3], v[:, :3], enable_gqa=True)
    with pytest.raises(UnsupportedModelError, match="3-D operands"):
        checked_sdpa(attn, q[0], k[0], v[0])
    torch.testing.assert_close(checked_sdpa(attn, q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))  # fmt: skip
