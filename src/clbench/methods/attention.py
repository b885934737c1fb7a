"""Entry points into a timm ``Attention`` for methods that change what it attends to (MEAT's key masks, the prompt
methods' prefixes): its queries, keys and values per head, and its output path, so that such an attention computes
exactly what timm's does around the one thing it changes."""

from __future__ import annotations

import torch
from torch import nn

Heads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def head_split(attn: nn.Module, x: torch.Tensor) -> Heads:
    """q, k, v of shape (B, heads, N, head_dim) (after timm's optional q/k norms) and the output gate (or None)."""
    b, n, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v, gate


def head_merge(attn: nn.Module, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The attention's per-head output (B, heads, N, head_dim) through timm's norm, gate, projection and dropout."""
    b, _, n, _ = out.shape
    out = attn.norm(out.transpose(1, 2).reshape(b, n, attn.attn_dim))
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out))


def split_heads(attn: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Vectors of the attention's width (B, L, heads * head_dim) as (B, heads, L, head_dim): channel c is head
    c // head_dim, as in timm's qkv layout."""
    b, length, _ = tokens.shape
    return tokens.reshape(b, length, attn.num_heads, attn.head_dim).transpose(1, 2)
