"""Tensor-parallel linear layers, checked on each rank's shard.

Under tensor parallelism (``torch.distributed.tensor.parallel``, as torchtitan's plan shards
Llama: ``ColwiseParallel`` for wq / wk / wv / w1 / w3, ``RowwiseParallel`` for wo / w2) a
linear layer's parameters are DTensors and its forward runs on DTensors. Each rank's GEMM is an
ordinary GEMM of local tensors, and that is what is checked, where it runs, with no
communication:

- **columns** (``Shard(0)`` of W (N, K), the input replicated): the rank computes N / tp of the
  outputs, ``y_r = x W_r^T + b_r``: a linear layer of its own, with N / tp outputs and the
  heads among them (a projection's head groups split evenly, or the layout is refused).
- **rows** (``Shard(1)``, the input sharded on its last dim): the rank computes a partial sum
  of every output, ``y_r = x_r W_r^T``, which ``RowwiseParallel`` then reduces (all-reduce or
  reduce-scatter). The check runs on the partial sum, *before* the reduction; an error in the
  reduction itself, or after it, is in the next layer's input, which no GEMM check of this
  layer sees (the next check that does: a projection check whose row sums see its input,
  or the guard's finite-gradient flag for an INF / NaN).

:func:`linear` computes a sharded layer's forward as the plain DTensor layer would, with the
local GEMM handed to the caller's checked function; :func:`local` reads a DTensor's shard for
the forward checks (the same tensor the DTensor holds: a repair in place repairs it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnchecker.errors import UnsupportedModelError

__all__ = ["COLUMNS", "ROWS", "is_sharded", "linear", "local", "local_groups", "split"]

COLUMNS, ROWS = "columns", "rows"


def _dtensor() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a DTensor (a tensor-parallel parameter, input or output)."""
    cls = _dtensor()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """``t``'s shard on this rank as a plain tensor (``t`` itself when not a DTensor): the very
    tensor the DTensor holds, so a check's repair in place reaches what the layer returns."""
    return t._local_tensor if is_sharded(t) else t  # (to_local() would be a fresh view)


def split(weight: Tensor, name: str = "a linear layer") -> str | None:
    """How ``weight`` (N, K) is split over its mesh: None (not a DTensor, or replicated),
    :data:`COLUMNS` (``Shard(0)``) or :data:`ROWS` (``Shard(1)``); any other layout (a mesh of
    more than one dimension, an uneven shard) is refused by name."""
    if not is_sharded(weight):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = weight.placements
    if len(placements) != 1:
        raise UnsupportedModelError(
            f"{name}: its weight is a DTensor on a {len(placements)}-dimensional mesh "
            f"({placements}); attnchecker checks tensor-parallel layers on a 1-D TP mesh"
        )
    (p,) = placements
    if isinstance(p, Replicate):
        return None
    if (
        isinstance(p, Shard)
        and p.dim in (0, 1)
        and weight.shape[p.dim] % weight.device_mesh.size() == 0
    ):
        return COLUMNS if p.dim == 0 else ROWS
    raise UnsupportedModelError(
        f"{name}: its weight is split as {p} of {tuple(weight.shape)} over "
        f"{weight.device_mesh.size()} ranks; attnchecker checks even Shard(0) (ColwiseParallel) "
        f"and Shard(1) (RowwiseParallel) layers"
    )


def local_groups(weight: Tensor, groups: int, name: str = "a projection") -> int:
    """The head groups of this rank's outputs: ``groups`` over its shard of the rows of W
    (columns split; heads split whole, as the parallel plan splits them), else all of them; a
    count that does not split (a linear layer's one group) is one group a rank (coarser
    locating, the same check)."""
    ranks = weight.device_mesh.size() if split(weight, name) == COLUMNS else 1
    return groups // ranks if groups % ranks == 0 else 1


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None,
    run: Callable[[Tensor, Tensor, Tensor | None], Tensor], name: str = "a linear layer",
) -> Tensor:  # fmt: skip
    """y = x W^T + b of a sharded ``weight``, as the DTensor layer returns it (``Shard(-1)``
    outputs for split columns, a ``Partial`` sum for split rows), its local GEMM computed by
    ``run(x_r, W_r, b_r)`` (the caller's checked linear). Gradients reach the DTensors as the
    plain layer's would: a replicated input's gradient is each rank's partial sum."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    how = split(weight, name)
    if how is None:
        raise ValueError(f"{name}: linear() takes a split weight (a replicated one runs as is)")
    mesh = weight.device_mesh
    if how == COLUMNS:
        want = (Replicate(),)
        out = (Shard(x.dim() - 1),)
        grad_x = (Partial(),)  # each rank's dX is a partial sum over its outputs
    else:
        want = (Shard(x.dim() - 1),)
        out = (Partial(),)
        grad_x = want
        if bias is not None:
            raise UnsupportedModelError(
                f"{name}: a row-split layer with a bias (added once, after the reduction) is "
                f"not checked by attnchecker"
            )
    if not is_sharded(x):  # (the parallel style converts its input: this is its own call)
        x = DTensor.from_local(x, mesh, want, run_check=False)
    elif tuple(x.placements) != want:
        x = x.redistribute(mesh, want)
    y = run(
        x.to_local(grad_placements=grad_x),
        weight.to_local(),
        None if bias is None else bias.to_local(),
    )
    shape = (*x.shape[:-1], weight.shape[0])
    return DTensor.from_local(y, mesh, out, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous(shape))  # fmt: skip


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
