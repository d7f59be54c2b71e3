"""The protected-attention acceptance checks on a CUDA device: clean equivalence (fp32 and bf16
autocast), no false alarm over a bf16 training loop, the fault matrix in fp32, and no host
synchronisation added by the checks.

Every test is marked ``gpu`` and skipped where ``torch.cuda.is_available()`` is false, so on a
CPU machine the module is collected and skipped. Nothing touches CUDA at import time.

The default on CUDA is the SDPA route (``backend="auto"``); the tests of the eager engine
(bitwise equal to the eager model, its fault matrices) pin ``backend="eager"`` (:data:`EAGER`),
and the route has its own (equal to the model's own SDPA attention, its fault matrix, its
kernels against their reference, no synchronisation, a CUDA graph).

fp32 comparisons need IEEE fp32 GEMMs: TF32 is switched off for this module (it is off by
default for matmuls in PyTorch, but a site configuration may turn it on, and the checks'
rounding bounds assume full fp32 accumulation). Tolerances of the fault matrix are the CPU
test's (loss within 1e-6 relative, gradients and updated parameters within 1e-5 absolute).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from attnchecker import ABFTConfig, protect_
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import build

from .helpers import (
    KINDS,
    PATTERNS,
    SITES,
    added_syncs,
    batch,
    bf16_q_row_fault,
    fault_matrix,
    max_diff,
    models,
    train_step,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FAULT_FAMILIES = ("gpt2", "bert", "llama")
EAGER = ABFTConfig(backend="eager")
REPORTED = {"probs": ("context",), "dp": ("dq", "dk")}  # the SDPA route's checks of a site
FAULT_KINDS = {k: KINDS[k] for k in ("inf", "nan", "1e10")}
TRAIN_STEPS = 20


CHECK_IMPL = "auto"
"""What this module's checks run: the default, as a CUDA user gets it (compiled check regions,
:data:`attnchecker.attention.impl.AUTO`), whatever the environment says: tests/conftest.py sets
``ATTNCHECKER_CHECK_IMPL=eager`` for the CPU suite, and the same test names must not run
different code on the device (``scripts/gpu_check.sh`` runs this module with the conftest)."""


@pytest.fixture(autouse=True, scope="module")
def _check_impl():
    """``$ATTNCHECKER_CHECK_IMPL`` set to :data:`CHECK_IMPL` while this module runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNCHECKER_CHECK_IMPL", CHECK_IMPL)
        yield


def test_the_checks_run_the_cuda_default():
    """A bf16 and an fp32 check on CUDA resolve to the Triton kernels (the GEMM checks' registered
    ops; the other regions compiled): what ran is what a user's default runs (the conftest's
    eager setting does not reach this module)."""
    from attnchecker.attention.impl import CheckImpl, resolve

    how = resolve("auto", torch.device("cuda"))
    assert how.name == "triton" and how.kernels
    assert {how.region(d) for d in (torch.bfloat16, torch.float32)} == {CheckImpl.COMPILED}


@pytest.fixture(autouse=True, scope="module")
def _ieee_fp32_matmul():
    """No TF32 while this module runs; the previous setting comes back afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def cuda_batch(family: str, **kw) -> dict[str, torch.Tensor]:
    """helpers.batch on the GPU (same values: it is drawn on the CPU and moved)."""
    return {k: v.cuda() for k, v in batch(family, **kw).items()}


def cuda_models(family: str, **kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical tiny models in train mode on the GPU (built on the CPU, then moved)."""
    a, b = models(family, **kw)
    return a.cuda(), b.cuda()


def _autocast(enabled: bool) -> torch.autocast:
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled)


# ------------------------------------------------------------------------ clean equivalence


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_clean_step_is_bitwise_unchanged_on_cuda(family, bf16):
    """Protected vs plain eager on CUDA: the same loss and every gradient bitwise (and in fp32
    the parameters after the AdamW step too), with no event and no detection."""
    protected, plain = cuda_models(family)
    inputs = cuda_batch(family)
    handle = protect_(protected, EAGER)
    with _autocast(bf16):
        got = train_step(protected, inputs)
        want = train_step(plain, inputs)
    assert got[0].is_cuda
    assert torch.isfinite(want[0])
    assert torch.equal(got[0], want[0])
    assert max_diff(got[1], want[1]) == 0.0
    if not bf16:  # the CPU bf16 test compares loss and gradients only
        assert max_diff(got[2], want[2]) == 0.0
    assert handle.drain() == []
    assert all(c["detected"] == 0 for c in handle.counters().values())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_every_check_region_compiles_on_cuda(bf16):
    """check_impl="compiled" (what "auto" takes on CUDA), every linear layer checked: each
    region that ran from eager code ran compiled, none fell back to its eager ops with a "did
    not compile" warning. In fp32 they all did until the TF32 question was read outside traced
    code (the runs of 2026-12-04: "torch.* op returned non-Tensor"; issue 41)."""
    from attnchecker.attention import regions

    protected, _ = cuda_models("llama")
    handle = protect_(protected, EAGER.replace(check_impl="compiled", scope="all_linear"))
    regions._RAN.clear()  # what ran in this test only (a failed compile stays in _FAILED)
    with warnings.catch_warnings(record=True) as seen, _autocast(bf16):
        warnings.simplefilter("always")
        train_step(protected, cuda_batch("llama"))
    assert not [str(w.message) for w in seen if "did not compile" in str(w.message)]
    ran = regions.describe()
    assert ran and all(how == "compiled" for how in ran.values()), ran
    assert handle.drain() == []


@pytest.mark.parametrize("family", FAMILIES)
def test_no_grad_inference_is_unchanged_on_cuda(family):
    protected, plain = cuda_models(family)
    protected.eval(), plain.eval()
    inputs = {k: v for k, v in cuda_batch(family).items() if k != "labels"}
    handle = protect_(protected, EAGER)
    with torch.no_grad():
        assert torch.equal(protected(**inputs).logits, plain(**inputs).logits)
    assert handle.drain() == []


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_fault_is_corrected_on_cuda(family):
    """As the CPU bf16 test: a NaN token row in Q under autocast is corrected to bf16 precision."""
    faulty, ref = cuda_models(family)
    got, want, events = bf16_q_row_fault(faulty, ref, cuda_batch(family), "cuda")
    assert torch.allclose(got[0], want[0], rtol=1e-2)
    assert max_diff(got[1], want[1]) <= 1e-2
    assert [e.action for e in events] == ["corrected"]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_false_alarm_over_a_bf16_training_loop_on_cuda(family):
    model = build(family).cuda()
    model.train()
    handle = protect_(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(TRAIN_STEPS):
        inputs = cuda_batch(family, seed=step)
        with _autocast(True):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    assert bool(torch.isfinite(torch.stack(losses)).all())
    assert handle.drain() == []
    assert handle.step == TRAIN_STEPS


# ------------------------------------------------------------------------------ fault matrix


@pytest.mark.parametrize("family", FAULT_FAMILIES)
def test_every_fault_is_corrected_on_cuda(family):
    """helpers.fault_matrix on a CUDA model and CUDA inputs (fp32): all 7 sites, kinds inf, nan
    and 1e10, patterns 0D, 1R, 1C, 2D: every fault fires, is reported corrected or recomputed
    (never uncorrectable), and the loss, gradients and updated parameters match the clean step."""
    base, _ = cuda_models(family)
    inputs = cuda_batch(family)
    failures = fault_matrix(
        base, inputs, train_step, config=EAGER, sites=SITES, kinds=FAULT_KINDS, patterns=PATTERNS
    )
    total = len(SITES) * len(FAULT_KINDS) * len(PATTERNS)
    assert not failures, f"{len(failures)} of {total}: {failures[:5]}"


# ---------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize("family", FAMILIES)
def test_protection_adds_no_host_sync_on_cuda(family):
    """A clean protected forward + backward on CUDA runs the syncing aten ops exactly as often
    as the plain model (transformers itself may synchronise; protection adds nothing)."""
    protected, plain = cuda_models(family)
    protect_(protected)
    inputs = cuda_batch(family)
    assert added_syncs(protected, plain, inputs) == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_protection_adds_no_cuda_synchronisation(family):
    """CUDA's own sync detector (``torch.cuda.set_sync_debug_mode``) sees no more synchronising
    calls (device-to-host copies, stream syncs, ...) in a protected forward + backward than in the
    plain model's. One step of each runs first, so one-off setup (cached index tensors, cuBLAS
    handles) is not counted."""
    protected, plain = cuda_models(family)
    protect_(protected)
    inputs = cuda_batch(family)
    for model in (plain, protected):
        model(**inputs).loss.backward()
    torch.cuda.synchronize()
    counts = []
    try:
        for model in (plain, protected):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    model(**inputs).loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append([str(w.message) for w in seen if "synchroniz" in str(w.message)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(counts[1]) <= len(counts[0]), counts[1]  # GPT-Neo's own attention syncs more


def test_model_moved_after_protect_runs_on_cuda():
    """protect_ on the CPU, then .cuda(): the clock and logs follow the model (no device error),
    a clean step stays bitwise equal to the plain one and a fault is still corrected."""
    protected, plain = models("llama")
    handle = protect_(protected)
    protected.cuda(), plain.cuda()
    inputs = cuda_batch("llama")
    got, want = train_step(protected, inputs), train_step(plain, inputs)
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0
    assert handle.drain() == []

    faulty, ref = models("llama")
    h = protect_(faulty)
    faulty.cuda(), ref.cuda()
    h.attach(
        lambda c: (
            c.tensor[0, 1, 2, 3].fill_(float("inf"))
            if c.site == "scores" and c.layer == 0 and not c.replay
            else None
        )
    )
    got, want = train_step(faulty, inputs), train_step(ref, inputs)
    assert torch.allclose(got[0], want[0], rtol=1e-6) and max_diff(got[1], want[1]) <= 1e-5
    assert [(e.op, e.action) for e in h.drain()] == [("scores", "corrected")]


# ------------------------------------------------------------------ backward and all_linear


@pytest.mark.parametrize("family", FAULT_FAMILIES)
def test_backward_faults_are_corrected_on_cuda(family):
    """As test_protect_backward: a fault in any backward GEMM repaired in the same backward,
    the step equal to the fault-free one (fp32, IEEE)."""
    import copy

    from .helpers import fire_once, update_excess

    base, ref = cuda_models(family)
    inputs = cuda_batch(family)
    want = train_step(ref, inputs)
    handle = protect_(base, EAGER)
    snapshot = copy.deepcopy(base.state_dict())
    sites = ("dq", "dk", "dp", "dv", "dx.q", "dw.q", "dx.out", "dw.out")
    failures = []
    for site in sites:
        for pattern, kind in zip(PATTERNS, ("nan", "inf", "1e10", "nan"), strict=True):
            base.load_state_dict(snapshot)
            base.zero_grad(set_to_none=True)
            hook = fire_once(site, pattern, kind)
            detach = handle.attach(hook, sites=[site])
            got = train_step(base, inputs)
            detach.remove()
            events = handle.drain()
            if not (
                hook.fired
                and max_diff(got[1], want[1]) <= 1e-5
                and update_excess(got, want) <= 1e-5
                and [e.action for e in events] in (["corrected"], ["recomputed"])
            ):
                failures.append((site, pattern, kind, max_diff(got[1], want[1]), events))
    assert not failures, failures[:4]


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_has_no_false_alarm_in_bf16_on_cuda(family):
    model = build(family).cuda()
    model.train()
    handle = protect_(model, ABFTConfig(scope="all_linear"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        with _autocast(True):
            loss = model(**cuda_batch(family, seed=step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert handle.drain() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_gemm_check_kernels_match_the_eager_check_on_cuda(dtype):
    """``check_impl="triton"``'s kernels (``attnchecker.kernels.gemm_check``) compiled for the
    GPU: no alarm on clean products in both operand layouts, and a NaN / INF / 1e30 element
    flagged and repaired as the eager ops do."""
    from attnchecker.attention.impl import resolve
    from attnchecker.attention.kernel_checks import gemm_check

    g = torch.Generator(device="cuda").manual_seed(0)
    for tx, ty in [(False, False), (True, False), (False, True)]:
        x = torch.randn(1024, 768, device="cuda", generator=g).to(dtype)
        y = (torch.randn(768, 2304, device="cuda", generator=g) / 768**0.5).to(dtype)
        x = x.t().contiguous().t() if tx else x
        y = y.t().contiguous().t() if ty else y
        clean = x @ y
        for bad in (None, float("nan"), float("inf"), 1e30):
            got = {}
            for impl in ("eager", "triton"):
                out = clean.clone()
                if bad is not None:
                    out[17, 300] = bad
                how = resolve(impl, out.device)
                assert how.kernels == (impl == "triton")
                res = gemm_check(how, out, x, y, max_rows=4, scale=1.0)
                got[impl] = out, [float(r) for r in res]
            (want_out, want), (out, res) = got["eager"], got["triton"]
            assert res[0:2] == want[0:2] and res[3:] == want[3:], (tx, ty, bad, res, want)
            assert res[0] == (0 if bad is None else 1), (tx, ty, bad, res)
            assert torch.isfinite(out).all()
            assert torch.allclose(out.float(), want_out.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_projection_check_kernels_compute_the_reference_on_cuda(dtype):
    """``attnchecker.kernels.projection_check`` compiled for the GPU (bf16 hi + lo references on
    the tensor cores): the excesses of the torch reference, no flag on a clean projection, and a
    NaN / INF / 1e30 element located, repaired and recorded."""
    from attnchecker.abft.tolerance import CAP, gemm_terms
    from attnchecker.kernels import projection_check as pc

    g = torch.Generator(device="cuda").manual_seed(0)
    T, K, G = 2048, 768, 36
    x = torch.randn(T, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(G * 64, K, device="cuda", generator=g) / K**0.5).to(dtype)
    b = torch.randn(G * 64, device="cuda", generator=g).to(dtype)
    clean = torch.nn.functional.linear(x, w, b)
    f_abs, f_mag = gemm_terms(dtype, x.device, inner=K + 1, length=64)
    lim = {"factor": 8 * f_mag, "floor": 1e-30, "absf": f_abs, "cap": 8 * CAP}  # row_limits
    sites = (0,) * 12 + (1,) * 12 + (2,) * 12
    ws = pc.proj_weights(w, b, G, False)
    for bad in (None, float("nan"), float("inf"), 1e30):
        y = clean.clone()
        if bad is not None:
            y[17, 773] = bad  # group 12: site 1
        want = pc.reference(y, x, w, b, False, G, **lim)
        log = torch.zeros(3, 7, dtype=torch.float64, device="cuda")
        step = torch.ones(1, dtype=torch.float64, device="cuda")
        scr = pc.check_(y, x, w, b, False, ws, sites, log, step, [0, 1, 2], **lim)
        exc = scr[2 * T * G : 3 * T * G].view(T, G)
        assert torch.equal(~(exc <= 0), ~(want["exc"] <= 0)), bad
        assert log[:, 0].tolist() == ([0, 0, 0] if bad is None else [0, 1, 0]), bad
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.float(), clean.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ models of one's own (SDPA)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
@pytest.mark.parametrize("layout", ["nanogpt", "litgpt"])
def test_a_model_of_ones_own_is_protected_on_cuda(layout, backend):
    """A nanoGPT / litgpt look-alike (tests/integration/sdpa_models.py) on the GPU, protected at
    its F.scaled_dot_product_attention calls with its projections found: a clean step equals
    its own (SDPA's CUDA kernels sum in another order: fp32 tolerance), and a NaN in the scores
    (eager) or in the fused kernels' S tile (triton) is corrected, with no host sync added."""
    import math

    import torch.nn.functional as F

    from attnchecker.kernels.flash import KernelFault

    from .sdpa_models import VOCAB, T
    from .sdpa_models import build as build_own

    idx = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1)).cuda()

    def step(model):
        model.zero_grad()
        logits = model(idx)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want = step(build_own(layout).cuda())
    model = build_own(layout).cuda()
    handle = protect_(model, ABFTConfig(backend=backend), example=(idx,))
    got = step(model)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(got[1], want[1], strict=True)) <= 1e-4
    assert handle.drain() == []
    block = handle.modules[0]
    if backend == "triton":
        handle.state(block).kernel_fault = KernelFault("s", 0, 1, 5, 3, math.nan)
        step(model)
        handle.state(block).kernel_fault = None
        site = "s"
    else:
        detach = handle.attach(
            lambda c: c.tensor[0, 1, 2, 3].fill_(math.nan), sites=("scores",), modules=(block,)
        )
        step(model)
        detach.remove()
        site = "scores"
    assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")]


# ------------------------------------------------------------------------------ CUDA graphs


@pytest.mark.parametrize("backend", ["eager", "auto"])
def test_a_protected_step_is_captured_in_a_cuda_graph(backend):
    """A whole protected training step (forward, backward, AdamW capturable) captured with
    torch.cuda.graph after a warm-up (spec gpu-path §6): its replays equal the same steps run
    uncaptured, bitwise, and drain() reads their records; a fault hook attached before the
    capture is part of the graph: every replay puts the INF in and corrects it (one event per
    replay), and the parameters still follow the clean twin. On the eager engine and on the
    default (the SDPA route: its repairs wait for a device flag, which a graph captures)."""
    ids = batch("llama")["input_ids"].cuda()
    arms = {}
    for name in ("clean", "graph", "faulty"):
        torch.manual_seed(0)
        model = build("llama").cuda().train()
        handle = protect_(model, ABFTConfig(backend=backend))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
        arms[name] = (model, handle, opt)

    def step(model, opt):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def hook(c):
        if c.site == "scores" and c.layer == 0:
            c.tensor[0, 1, 2, 3] = float("inf")

    arms["faulty"][1].attach(hook)
    graphs = {}
    for name in ("graph", "faulty"):
        model, handle, opt = arms[name]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step(model, opt)
        torch.cuda.current_stream().wait_stream(side)
        handle.drain()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            step(model, opt)
    clean, handle = arms["clean"][0], arms["clean"][1]
    for _ in range(3):  # the clean twin: 3 warm-up steps + the captured one, uncaptured
        step(clean, arms["clean"][2])
    handle.drain()
    for _ in range(3):
        step(clean, arms["clean"][2])
        graphs["graph"].replay()
        graphs["faulty"].replay()
        torch.cuda.synchronize()
        assert arms["graph"][1].drain() == []
        assert [(e.op, e.action) for e in arms["faulty"][1].drain()] == [("scores", "corrected")]
    for (n, p), q, r in zip(clean.named_parameters(), arms["graph"][0].parameters(),
                            arms["faulty"][0].parameters(), strict=True):  # fmt: skip
        assert torch.equal(p, q), n
        torch.testing.assert_close(r, p, rtol=1e-5, atol=1e-5, msg=n)


# ------------------------------------------------------------------- the SDPA route (default)

ROUTE_FAMILIES = ("llama", "gpt2", "mistral")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("family", ROUTE_FAMILIES)
def test_the_cuda_default_is_the_sdpa_route_and_equals_sdpa(family, bf16):
    """protect_(model) on CUDA runs the SDPA route (its self-test passed here); a clean step
    equals the plain model's own SDPA attention (the same kernel; the checks write nothing) and
    reports nothing."""
    base, plain = cuda_models(family, dropout=False)
    plain.set_attn_implementation("sdpa")
    handle = protect_(base)
    assert {c["engine"] for c in handle.summary()["per_module"].values()} == {"sdpa"}
    inputs = cuda_batch(family)
    with _autocast(bf16):
        got, want = train_step(base, inputs), train_step(plain, inputs)
    tol = 1e-2 if bf16 else 1e-5
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    assert max_diff(got[1], want[1]) <= (5e-2 if bf16 else 1e-4)
    assert handle.drain() == []


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_sdpa_route_corrects_faults_on_cuda(family):
    """The route's fault matrix on CUDA (fp32): every site of the core, forward and backward,
    kinds inf, nan and 1e10, every pattern: corrected in the same step by the Triton kernels'
    repairs (reported by the check that sees it: a fault in P by the context's, one in dP by
    dQ's and dK's)."""
    base, _ = cuda_models(family, dropout=False)
    failures = fault_matrix(
        base, cuda_batch(family), train_step, config=ABFTConfig(backend="sdpa"),
        sites=("scores", "probs", "context", "dq", "dk", "dp", "dv"), kinds=FAULT_KINDS,
        patterns=PATTERNS, reported=REPORTED,
    )  # fmt: skip
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sdpa_kernels_match_their_reference_on_cuda(dtype):
    """The route's six Triton kernels against the torch reference on CUDA tensors: no flag on
    clean results, the same flags on corrupted ones, repairs back to the backend's values."""
    import math

    from attnchecker.kernels import sdpa_backend as backend
    from attnchecker.kernels import sdpa_kernels as kern
    from attnchecker.kernels import sdpa_kernels_bwd as kb

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 200, 64, generator=g).to("cuda", dtype) for h in (8, 2, 2))
    out, lse, aux = backend.attention_forward(q, k, v, None, True, 0.125)
    grad = torch.randn(out.shape, generator=g).to("cuda", dtype)
    dq, dk, dv = backend.attention_backward(grad, q, k, v, out, lse, None, True, 0.125, aux)
    rowmax, step = torch.zeros(1, 1, 1, device="cuda"), torch.ones(1, device="cuda")
    stats = kern.kv_stats(k, v)
    bad_out = out.clone()
    bad_out[1, 3, 50, :] = math.inf
    log = torch.zeros(2, 7, dtype=torch.float64, device="cuda")
    flags = kern.fwd_verify(q, k, bad_out, lse, stats, rowmax, 0.125, 1.0)
    kern.fwd_repair(q, k, v, None, bad_out, lse, stats, rowmax, flags, log, step, (0, 1), True,
                    0.125, 1.0)  # fmt: skip
    torch.testing.assert_close(bad_out.float(), out.float(), rtol=2e-2, atol=2e-2)
    assert log[1, [0, 3, 5]].tolist() == [1, 0, 1] and log[0].sum() == 0
    rec = torch.zeros(3, 7, dtype=torch.float64, device="cuda")
    bad = [t.clone() for t in (dq, dk, dv)]
    bad[0][0, 5, 9, 3] = math.nan
    part, qflags = kb.bwd_rows(q, k, lse, grad, bad[0], stats, rowmax, 0.125, 1.0)
    sums = kb.bwd_cols(bad[1], bad[2])
    kb.bwd_repair(q, k, v, None, out, lse, grad, *bad, stats, rowmax, part, qflags, sums, rec,
                    step, (0, 1, 2), True, 0.125, 1.0)  # fmt: skip
    for got, want in zip(bad, (dq, dk, dv), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    assert rec[0, [0, 3, 5]].tolist() == [1, 0, 1] and rec[1:].sum() == 0


def test_the_flash_kernels_own_gqa_is_used_where_it_agrees():
    """Issue 54: the route expands K / V for GQA unless the flash kernel takes them as they are
    (``sdpa_backend.probe_gqa``, run by the route's self-test): on an H100 / H200 with torch's
    FlashAttention-2 it should, and then the route's output and gradients equal SDPA's with
    ``enable_gqa`` as before (the self-test passes on that path)."""
    from attnchecker.attention.sdpa_core import self_test
    from attnchecker.kernels import sdpa_backend

    assert self_test("cuda") is None
    print("flash takes GQA natively:", sdpa_backend.GQA_NATIVE.get("cuda"))
    assert sdpa_backend.GQA_NATIVE.get("cuda") is not None
