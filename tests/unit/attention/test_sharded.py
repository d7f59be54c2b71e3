"""``attention.sharded`` on a one-rank gloo mesh (in this process): how a DTensor weight is
split, the local head groups, and ``linear``: the sharded layer's output and gradients equal
the DTensor layer's, through the caller's local GEMM. The four-rank run (two of them a TP
pair) is ``tests/integration/test_torchtitan_parallel.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from attnchecker.attention import sharded
from attnchecker.errors import UnsupportedModelError


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _weight(mesh, placement):
    from torch.distributed.tensor import distribute_tensor

    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    return distribute_tensor(w, mesh, (placement,)).requires_grad_()


def test_the_split_of_a_weight(mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    assert sharded.split(torch.randn(8, 6)) is None
    assert sharded.split(_weight(mesh, Replicate())) is None
    assert sharded.split(_weight(mesh, Shard(0))) == sharded.COLUMNS
    assert sharded.split(_weight(mesh, Shard(1))) == sharded.ROWS
    two = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    from torch.distributed.tensor import distribute_tensor

    w = distribute_tensor(torch.randn(8, 6), two, (Replicate(), Shard(0)))
    with pytest.raises(UnsupportedModelError, match="2-dimensional mesh"):
        sharded.split(w, "wq")
    assert sharded.local_groups(_weight(mesh, Shard(0)), 4) == 4  # one rank holds every head
    assert sharded.local(_weight(mesh, Shard(0))) is not None


@pytest.mark.parametrize("dim", [0, 1], ids=["columns", "rows"])
def test_linear_equals_the_dtensor_layer_with_its_gradients(mesh, dim):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    place = Shard(dim)
    x_plain = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(1))
    grads = []
    for route in ("dtensor", "sharded"):
        w = _weight(mesh, place)
        xin = Replicate() if dim == 0 else Shard(2)
        x = DTensor.from_local(x_plain.clone().requires_grad_(), mesh, (xin,))
        x.retain_grad()
        calls = []
        if route == "dtensor":
            y = F.linear(x, w)
        else:

            def run(xr, wr, br, calls=calls):
                calls.append((type(xr), type(wr)))
                return F.linear(xr, wr, br)

            y = sharded.linear(x, w, None, run)
        y.full_tensor().pow(2).sum().backward()
        grads.append((y.full_tensor().detach(), w.grad.full_tensor(), x.grad.full_tensor()))
        if route == "sharded":
            assert calls == [(torch.Tensor, torch.Tensor)]  # the local GEMM, plain tensors
            assert y.placements == ((Shard(2),) if dim == 0 else (Partial(),))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
