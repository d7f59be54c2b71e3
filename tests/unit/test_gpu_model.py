"""The GPU step model of ``attnchecker.gpu_cost`` (``OpTrace``, ``H200``; spec gpu-path §7):
what each op is charged (a GEMM by its FLOPs, an elementwise op by its bytes, a tiny op the
kernel floor), the host's launches in eager and none in a CUDA graph, and the same trace on real
tensors and under FakeTensorMode (shapes only, the way Llama-8B widths are traced here). The
calibration against the H200's measured steps is ``benchmarks/gpu_model.py``'s."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attnchecker import protect_
from attnchecker.gpu_cost import H200, Device, Modelled, OpTrace
from attnchecker.models.tiny import build


def test_each_op_is_charged_by_its_flops_its_bytes_or_the_floor():
    with FakeTensorMode():
        a, c = torch.empty(2, 4096, 4096, dtype=torch.bfloat16).unbind(0)
        b = torch.empty(8)
        with OpTrace() as t:
            a @ c  # 2 * 4096^3 FLOPs, 3 * 32 MiB: compute-bound
            a + c  # 3 * 32 MiB: memory-bound
            b.add_(1)  # a few bytes: the floor
            torch.empty_like(a)  # an allocation: no kernel
    (mm, f1, b1), (add, f2, b2), (tiny, f3, b3) = t.work
    assert (mm, add, tiny) == ("aten.mm", "aten.add", "aten.add_")
    assert f1 == 2 * 4096**3 and b1 == b2 == 3 * 4096 * 4096 * 2
    assert f2 == f3 == 0 and b3 == 8 * 4  # add_'s output is its input: counted once
    m = t.modelled(H200)
    gemm, copy = f1 / H200.flops, b2 / H200.bandwidth
    assert gemm > b1 / H200.bandwidth  # the GEMM is charged its FLOPs, not its bytes
    assert m.device == pytest.approx(gemm + copy + H200.kernel)
    assert m.launches == 3 and m.host == pytest.approx(3 * H200.launch)
    assert m.step() == max(m.host, m.device) and m.step(graph=True) == m.device
    slow = Device("slow", bandwidth=1e9, flops=1e12, kernel=1e-3, launch=0.0)
    assert t.modelled(slow).device == pytest.approx(f1 / 1e12 + b2 / 1e9 + 1e-3)
    assert Modelled(5, 1.0, 2.0).step() == 2.0


def _step(model, ids) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("protected", [False, True], ids=["plain", "protected"])
def test_the_trace_under_fake_tensors_is_the_real_one(protected):
    """A tiny protected llama's training step traced on real tensors and under FakeTensorMode
    (built fake, protected outside it: its probe compares real numbers): the same launching
    ops, op by op, but for the mask, which transformers builds in full when it cannot look at
    the values (a handful of ops); protection adds its checks either way."""
    traces = []
    for fake in (False, True):
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        with mode or torch.no_grad():
            torch.manual_seed(0)
            model = build("llama", layers=2, max_len=64)
        model.config.use_cache = False
        model.train()
        if protected:
            protect_(model)
        ids = torch.randint(3, 100, (2, 32), generator=torch.Generator().manual_seed(0))
        with mode or torch.enable_grad():
            _step(model, ids)
            with OpTrace() as t:
                _step(model, ids)
        traces.append(t)
    real, fake = traces
    assert 0 <= len(fake.work) - len(real.work) <= 40, (len(real.work), len(fake.work))
    mm = [w for w in real.work if w[0] in ("aten.mm", "aten.addmm", "aten.bmm")]
    assert mm == [w for w in fake.work if w[0] in ("aten.mm", "aten.addmm", "aten.bmm")]
    assert "prim.device" not in {op for op, *_ in fake.work}


def test_the_cpu_flash_attention_is_charged_as_the_cuda_one():
    """SDPA on a CPU runs its own flash kernel, which torch's FLOP counter does not know: the
    model charges it (and its backward) the CUDA flash kernel's FLOPs, 4 B H L^2 d forward."""
    with FakeTensorMode():
        q, k, v = torch.empty(3, 1, 8, 256, 64, requires_grad=True).unbind(0)
        with OpTrace() as t:
            torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    flops = {op: f for op, f, _ in t.work if "flash" in op}
    assert flops == {"aten._scaled_dot_product_flash_attention_for_cpu": 4 * 8 * 256**2 * 64,
                     "aten._scaled_dot_product_flash_attention_for_cpu_backward":
                         2.5 * 4 * 8 * 256**2 * 64}, flops  # fmt: skip


def test_a_triton_launch_is_charged_by_what_its_programs_can_stream():
    """A launch's bytes at min(bandwidth, programs x the per-program rate): one program over
    100 MB is serial, a launch that fills the SMs reaches the bandwidth; a repair that
    returns on a clean flag is charged its flags, not its arguments."""
    from attnchecker.gpu_cost import SMS, clean_exit
    from attnchecker.kernels.launches import Launch

    one = H200.triton_time(100e6, 1)
    assert one == pytest.approx(100e6 / H200.program_rate)
    assert H200.triton_time(100e6, 4 * SMS) == pytest.approx(100e6 / H200.bandwidth)
    assert one > 100 * H200.triton_time(100e6, 4 * SMS)
    t = OpTrace()
    t.launches = [
        Launch("fwd_repair_kernel", (128, 32, 1), 10**9),
        Launch("verify_kernel", (1, 1, 1), 10**8),
    ]
    times = t.device_time(H200)
    assert clean_exit("fwd_repair_kernel") and not clean_exit("verify_kernel")
    assert times["triton.fwd_repair_kernel"] == pytest.approx(H200.kernel)  # 4096 x 128 B
    assert times["triton.verify_kernel"] == pytest.approx(1e8 / H200.program_rate)


def test_a_registered_op_is_charged_its_own_ops_and_launches():
    """The trace looks into attnchecker's registered ops: the GEMM check's reference pass is
    its Triton launches (recorded with their grids, nothing run) and the aten ops inside,
    not one op charged for its arguments."""
    from attnchecker import kernels
    from attnchecker.kernels.launches import SkipCompute, recorded

    if not kernels.available():
        pytest.skip("needs triton (or its interpreter)")
    from attnchecker.kernels import gemm_check as gc

    w = torch.empty(2304, 768, dtype=torch.bfloat16)
    with SkipCompute(), recorded(run=False), OpTrace() as t:
        gc.gemm_refs(w)
    assert t.ops["attnchecker.gemm_refs"] == 1
    assert t.launches and all(n.kernel.endswith("kernel") for n in t.launches)
    assert t.launched == len(t.work) + len(t.launches)
    assert all(not op.startswith("attnchecker") for op, *_ in t.work)


def test_a_traced_step_takes_the_gpus_path():
    """``traced_step`` at a tiny width and L 4096, nothing computed: the protected step on the
    SDPA route (as CUDA runs it) records the route's kernels and expands K / V for GQA as the
    CUDA path does (two copies forward, two backward, and the group sums of dK and dV), which
    the CPU path does not."""
    from attnchecker import ABFTConfig, kernels
    from attnchecker.gpu_cost import traced_step

    if not kernels.available():
        pytest.skip("needs triton (or its interpreter)")
    tiny = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "head_dim": 16}  # fmt: skip
    plain = traced_step(None, L=4096, vocab=128, widths=tiny)
    prot = traced_step(ABFTConfig(backend="sdpa", check_impl="triton"), L=4096, vocab=128,
                       widths=tiny)  # fmt: skip
    assert not plain.launches
    names = {n.kernel for n in prot.launches}
    assert {"fwd_verify_kernel", "fwd_repair_kernel", "bwd_check_kernel"} <= names
    ops = {op for op, *_ in prot.work}
    # CUDA's flash kernel, on its meta: no mask decided from garbage values (found 2026-12-06:
    # at L 4096 transformers built a full mask from uncomputed tensors, and the route took the
    # memory-efficient kernel, +1.4 ms a layer at Llama-8B widths)
    assert "aten._scaled_dot_product_flash_attention" in ops
    assert not any("efficient" in op for op in ops)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in {op for op, *_ in plain.work}
    from collections import Counter

    more = Counter(op for op, *_ in prot.work)
    more.subtract(Counter(op for op, *_ in plain.work))
    assert more["aten.clone"] >= 4 and more["aten.sum"] >= 2, more
    assert prot.modelled(H200).device > plain.modelled(H200).device


def test_with_the_flash_kernels_own_gqa_the_route_copies_nothing():
    """Where the device's flash kernel takes K / V of fewer heads (``sdpa_backend.probe_gqa``),
    the route passes them as they are: no expansion copies, no group sums of dK and dV."""
    from collections import Counter

    from attnchecker import ABFTConfig, kernels
    from attnchecker.gpu_cost import traced_step

    if not kernels.available():
        pytest.skip("needs triton (or its interpreter)")
    tiny = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "head_dim": 16}  # fmt: skip
    cfg = ABFTConfig(backend="sdpa", check_impl="triton")
    ops = [Counter(op for op, *_ in traced_step(cfg, L=64, vocab=128, widths=tiny,
                                                native_gqa=native).work)
           for native in (False, True)]  # fmt: skip
    expanded, native = ops
    assert expanded["aten.clone"] - native["aten.clone"] >= 4
    assert expanded["aten.sum"] - native["aten.sum"] == 2
