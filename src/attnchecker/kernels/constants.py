"""Constant tensors on a device, made once: the one cache of them.

A tensor made from host values (``torch.tensor`` of indices, a causal mask) is a host-to-device
copy, which synchronises a CUDA stream and which a CUDA graph does not capture; so each is made
once per key and device from eager code and kept. Under ``torch.compile`` a kept one is taken
as it is (the graph reads it: no kernel), one not yet made is made in the graph (a constant of
it, a kernel a call) and not kept; under a fake mode (a shapes-only trace) it is not kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["device_constant"]

_CONSTANTS: dict[tuple[Hashable, torch.device], Tensor] = {}


def device_constant(key: Hashable, device: torch.device, make: Callable[[], Tensor]) -> Tensor:
    """The constant ``make()`` (a tensor on ``device``) of ``key``, made once per device."""
    slot = (key, torch.device(device))
    hit = _CONSTANTS.get(slot)
    if torch.compiler.is_compiling():
        return make() if hit is None else hit
    if hit is None:
        hit = make()
        if not isinstance(hit, FakeTensor):
            _CONSTANTS[slot] = hit
    return hit
