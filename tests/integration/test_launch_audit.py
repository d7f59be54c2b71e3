"""Issue 54's launch audit, in the default run: every Triton launch of one protected training
step at Llama-8B widths (hidden 4096, 32 heads over 8 K/V heads, MLP 14336, L 4096, vocabulary
32,000, bf16 autocast over fp32 weights), recorded on this CPU without running anything
(:func:`attnchecker.gpu_cost.launch_audit`), keeps a GPU busy: no launch streams more than
2 MB of arguments a program, none with fewer programs than an H100 has SMs touches more than
32 MB. Counts and sizes, not times (what a program reaches per second is the GPU's to say).
``python benchmarks/launch_audit.py`` prints every launch."""

from __future__ import annotations

import pytest

from attnchecker import ABFTConfig, kernels
from attnchecker.gpu_cost import (
    FEW_PROGRAMS_MAX,
    PER_PROGRAM_MAX,
    SMS,
    audit_failures,
    launch_audit,
)
from attnchecker.kernels.launches import Launch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")

SDPA_KERNELS = ("kv_stats_kernel", "fwd_verify_kernel", "fwd_repair_kernel", "bwd_q_kernel",
                "bwd_kv_kernel", "bwd_check_kernel", "bwd_repair_q_kernel",
                "bwd_repair_kv_kernel")  # fmt: skip


@pytest.mark.parametrize("scope", ["attention", "all_linear"])
def test_every_launch_of_a_protected_step_fills_a_gpu(scope):
    launches = launch_audit(ABFTConfig(backend="sdpa", check_impl="triton", scope=scope))
    assert audit_failures(launches) == []
    names = [n.kernel for n in launches]
    # the route's seven kernels once each (one layer), every projection checked
    assert [k for k in names if k in SDPA_KERNELS] == list(SDPA_KERNELS)
    checked = names.count("weights_kernel")
    assert checked == (4 if scope == "attention" else 8)  # q|k|v fused or not, o; + MLP, head


def test_the_rules_catch_a_serial_launch():
    """The rules themselves: one program over a whole weight, and few programs over much."""
    assert audit_failures([Launch("one", (1, 1, 1), int(PER_PROGRAM_MAX) + 1)])
    assert audit_failures([Launch("few", (SMS - 1, 1, 1), int(FEW_PROGRAMS_MAX) + 1)])
    assert not audit_failures([Launch("wide", (SMS, 1, 1), int(FEW_PROGRAMS_MAX) + 1)])
