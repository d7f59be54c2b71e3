"""Shared by the protected-attention tests: tiny models, a batch, one training step."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from attnchecker.inject import exponent_flip
from attnchecker.models.tiny import build

SITES = ("q", "k", "v", "scores", "probs", "context", "out")
KINDS = {
    "inf": lambda x: torch.full_like(x, float("inf")),
    "-inf": lambda x: torch.full_like(x, float("-inf")),
    "nan": lambda x: torch.full_like(x, float("nan")),
    "1e10": lambda x: torch.full_like(x, 1e10),
    "exp_flip": exponent_flip,
    "random_large": lambda x: (
        x + torch.empty_like(x).uniform_(1e4, 1e8, generator=torch.Generator().manual_seed(7))
    ),
}
PATTERNS = ("0D", "1R", "1C", "2D")


def pattern_index(t: Tensor, pattern: str) -> tuple:
    """Where a pattern lands in a site tensor: projections (B, L, N) are the flattened GEMM
    (B * L tokens by N features); attention tensors (B, H, L, M) are per-head matrices."""
    if t.dim() == 3:
        return {
            "0D": (1, 5, 3),
            "1R": (1, 5, slice(None)),
            "1C": (slice(None), slice(None), 7),
            "2D": (1, slice(2, 5), slice(4, 9)),
        }[pattern]
    return {
        "0D": (1, 2, 5, 3),
        "1R": (1, 2, 5, slice(None)),
        "1C": (0, 1, slice(None), 4),
        "2D": (1, 3, slice(2, 5), slice(3, 7)),
    }[pattern]


def batch(family: str, B: int = 2, L: int = 16, seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, L - 4 :] = 0  # padding in the second sample
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def train_step(model: nn.Module, inputs: dict[str, Tensor], *, lr: float = 1e-3):
    """One AdamW step from fresh optimizer state: (loss, grads, params after the step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(1234)  # same dropout masks in every arm
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, params


def models(family: str, **kw) -> tuple[nn.Module, nn.Module]:
    m = build(family, **kw)
    m.train()
    return m, copy.deepcopy(m)


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)
