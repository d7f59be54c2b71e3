"""Look-alikes of models written outside transformers, each calling
``F.scaled_dot_product_attention`` the way its library does (written here: those libraries are
not installed, or, like timm, do not import with the CPU torch), PyTorch's own
``nn.TransformerEncoder`` (``nn.MultiheadAttention``), and attention by hand (timm with fused
attention off), which protect_ must refuse.

Every model maps token ids (B, T) to logits (B, T, VOCAB), so one training step fits all."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D, HEADS, T = 64, 32, 4, 16


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, H, T, hd), rotate-half form."""
    hd, t = x.shape[-1], x.shape[-2]
    f32 = {"dtype": torch.float32, "device": x.device}
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, **f32) / hd))
    ang = torch.outer(torch.arange(t, **f32), inv)  # (T, hd/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class NanoGPTAttention(nn.Module):
    """nanoGPT: one fused c_attn split contiguously into Q | K | V, causal SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T_, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T_, C))


class LitGPTAttention(nn.Module):
    """litgpt: one fused qkv, contiguous Q | K | V with 2 KV heads (GQA), RoPE, enable_gqa."""

    KV = 2

    def __init__(self) -> None:
        super().__init__()
        self.hd = D // HEADS
        self.qkv = nn.Linear(D, (HEADS + 2 * self.KV) * self.hd, bias=False)
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, _ = x.shape
        q, k, v = self.qkv(x).split((HEADS * self.hd, self.KV * self.hd, self.KV * self.hd), -1)
        q = q.view(B, T_, HEADS, self.hd).transpose(1, 2)
        k, v = (t.view(B, T_, self.KV, self.hd).transpose(1, 2) for t in (k, v))
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T_, D))


class TitanAttention(nn.Module):
    """torchtitan: wq / wk / wv, RoPE, K and V repeated to the query heads by hand, a scale."""

    KV = 2

    def __init__(self) -> None:
        super().__init__()
        self.hd = D // HEADS
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, self.KV * self.hd, bias=False)
        self.wv = nn.Linear(D, self.KV * self.hd, bias=False)
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, _ = x.shape
        q = self.wq(x).view(B, T_, HEADS, self.hd).transpose(1, 2)
        k, v = (w(x).view(B, T_, self.KV, self.hd).transpose(1, 2) for w in (self.wk, self.wv))
        rep = HEADS // self.KV
        k, v = (t.repeat_interleave(rep, 1) for t in (rope(k), v))
        y = F.scaled_dot_product_attention(rope(q), k, v, is_causal=True, scale=0.3)
        return self.wo(y.transpose(1, 2).reshape(B, T_, D))


class TimmAttention(nn.Module):
    """timm's ViT: qkv reshaped (B, N, 3, H, hd) and unbound, no mask (bidirectional); with
    ``fused=False`` the hand-written path, q @ k^T, softmax, @ v."""

    def __init__(self, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = (q * (C // HEADS) ** -0.5) @ k.transpose(-2, -1)
            y = attn.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class NeoXAttention(nn.Module):
    """GPT-NeoX's layout in a model of one's own: one fused query_key_value whose outputs are
    interleaved per head, [q_h | k_h | v_h], RoPE on Q and K."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value, self.dense = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, _ = x.shape
        qkv = self.query_key_value(x).view(B, T_, HEADS, 3 * (D // HEADS)).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(B, T_, D))


class MegatronAttention(nn.Module):
    """Megatron-LM's linear_qkv (torchtitan's wqkv): one fused projection whose outputs are
    interleaved per KV group, [the query heads of group g | k_g | v_g], 2 KV groups of 2 query
    heads (GQA with enable_gqa), RoPE on Q and K."""

    KV = 2

    def __init__(self) -> None:
        super().__init__()
        self.hd = D // HEADS
        self.linear_qkv = nn.Linear(D, (HEADS + 2 * self.KV) * self.hd)
        self.linear_proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, _ = x.shape
        r = HEADS // self.KV  # query heads a group
        qkv = self.linear_qkv(x).view(B, T_, self.KV, (r + 2) * self.hd)
        q, k, v = qkv.split((r * self.hd, self.hd, self.hd), -1)
        q = q.reshape(B, T_, HEADS, self.hd).transpose(1, 2)  # query head g * r + i
        k, v = (t.transpose(1, 2) for t in (k, v))  # (B, KV, T, hd)
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        return self.linear_proj(y.transpose(1, 2).reshape(B, T_, D))


class ParallelScalingBlock(nn.Module):
    """timm's ParallelScalingBlock (ViT-22B style), a whole block: one in_proj whose outputs are
    [MLP input | Q | K | V], split with torch.split; LayerNorm on Q and K per head (qk_norm);
    bidirectional SDPA; the attention's and the MLP's output projections summed into the
    residual."""

    whole_block = True  # LM takes it as a block, not as the attention of one

    def __init__(self, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.hd, hidden = D // HEADS, mlp_ratio * D
        self.in_split = [hidden, D, D, D]
        self.in_norm = nn.LayerNorm(D)
        self.in_proj = nn.Linear(D, hidden + 3 * D)
        self.q_norm, self.k_norm = nn.LayerNorm(self.hd), nn.LayerNorm(self.hd)
        self.attn_out_proj = nn.Linear(D, D)
        self.mlp_act = nn.GELU()
        self.mlp_out_proj = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        x_mlp, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        q = self.q_norm(q.view(B, N, HEADS, self.hd)).transpose(1, 2)
        k = self.k_norm(k.view(B, N, HEADS, self.hd)).transpose(1, 2)
        v = v.view(B, N, HEADS, self.hd).transpose(1, 2)
        x_attn = F.scaled_dot_product_attention(q, k, v)
        x_attn = self.attn_out_proj(x_attn.transpose(1, 2).reshape(B, N, C))
        x_mlp = self.mlp_out_proj(self.mlp_act(x_mlp))
        return x + x_attn + x_mlp


class XTransformersAttention(nn.Module):
    """x-transformers (attn_flash=True): to_q / to_k / to_v, SDPA inside a separate Attend
    module with a boolean key padding mask (True attends) broadcast over heads and queries."""

    class Attend(nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])

    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.to_out = nn.Linear(D, D)
        self.attend = self.Attend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, _ = x.shape
        q, k, v = (
            w(x).view(B, T_, HEADS, D // HEADS).transpose(1, 2)
            for w in (self.to_q, self.to_k, self.to_v)
        )
        keep = torch.ones(B, T_, dtype=torch.bool)
        keep[:, -3:] = False  # the last three tokens are padding
        y = self.attend(q, k, v, keep.to(x.device))
        return self.to_out(y.transpose(1, 2).reshape(B, T_, D))


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = attn
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class LM(nn.Module):
    """Embeddings, ``layers`` blocks of the given attention (or of the block itself, one with
    ``whole_block``), a head."""

    def __init__(
        self, attention: type[nn.Module], layers: int = 2, vocab: int = VOCAB, length: int = T, **kw
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(length, D)
        whole = getattr(attention, "whole_block", False)
        self.h = nn.ModuleList(
            attention(**kw) if whole else Block(attention(**kw)) for _ in range(layers)
        )
        self.lm_head = nn.Linear(D, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


class EncoderLM(nn.Module):
    """PyTorch's own nn.TransformerEncoder (nn.MultiheadAttention inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.encoder(self.wte(idx)))


LAYOUTS = {
    "nanogpt": NanoGPTAttention,
    "litgpt": LitGPTAttention,
    "torchtitan": TitanAttention,
    "timm": TimmAttention,
    "x_transformers": XTransformersAttention,
    "neox": NeoXAttention,
    "megatron": MegatronAttention,
    "timm_parallel": ParallelScalingBlock,
}
"""Each layout's attention module, by the library it imitates."""


def build(layout: str, seed: int = 0, **kw) -> nn.Module:
    """The model of ``layout`` (:data:`LAYOUTS`, or ``"torch_encoder"``: :class:`EncoderLM`)."""
    torch.manual_seed(seed)
    if layout == "torch_encoder":
        return EncoderLM()
    return LM(LAYOUTS[layout], **kw)


MODELS = (*LAYOUTS, "torch_encoder")


def nanogpt(vocab_size: int, seq_len: int) -> nn.Module:
    """A factory as ``attnchecker train / campaign`` take one (``package.module:function``)."""
    return LM(NanoGPTAttention, vocab=vocab_size, length=seq_len)
