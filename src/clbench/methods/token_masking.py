"""Key masks over a ViT's tokens (MEAT's attention to self-attention, Xue et al., CVPR 2022, Eqs. 4-5).

A binary keep-mask m over the patch tokens of a layer (prefix tokens such as CLS always kept) removes the
masked tokens as keys for every head: Psi_ij = m_j exp(A_ij) / sum_s m_s exp(A_is). Queries and outputs of
all tokens are still computed. Both paths below run PyTorch's fused scaled-dot-product attention:

- a mask without gradient (evaluation, stored masks) becomes an additive key bias, 0 for kept and -inf for
  masked tokens;
- a mask that carries a gradient (training, straight-through Gumbel samples) needs dL/dm_j also for masked
  tokens, where an additive bias -inf has none. The values are extended to [m_j v_j, m_j]: attention over all
  keys then gives numerator and denominator of Eq. 5, whose ratio is exactly Psi v, differentiable in m. Flash
  attention (CUDA and CPU) needs equal q/k/v widths that are multiples of 8, so q, k and the extended values are
  all padded with zero columns to the next multiple of 8 above head_dim (zero columns leave q.k unchanged; the
  scale stays head_dim^-0.5). Unpadded, the width head_dim + 1 sends attention to the unfused math kernel.
  A masked key whose logit exceeded every kept one by ~100 would make both numerator and denominator underflow
  (0/0). So each masked key j is biased down by b_j = max(0, c_j - 20), where c_j = max_i |q_i| |k_j - k_0| / sqrt(d)
  bounds how far its logit can exceed the always-kept key 0's, and its extended value is scaled by e^{b_j}: the
  ratio and its gradient are unchanged, and the kept keys' share of the softmax never falls below e^-20/N, so the
  ratio's gradient (1/share^2) stays finite too. The forward and the q/k/v gradients are exact for any logits; a
  masked key's mask gradient is exact while b_j <= 30 and scaled down by e^(30 - b_j) beyond (never inf or NaN).

Masks are (N,), one per layer, or (B, N), one per image (MEAT's training samples).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clbench.backbones.refiner import MAX_SCALE, RefinerAttention
from clbench.methods.attention import head_merge, head_split

WIDTH_ALIGN = 8  # flash attention takes equal q/k/v widths that are multiples of 8
KEPT_SHARE = 20.0  # after its bias, a masked key's logit exceeds key 0's by at most this: share >= e^-20 / N


def key_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A keep-mask over the N keys, (N,) or (B, N) -> additive attention bias of shape (1 or B, 1, 1, N)."""
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(keep == 0, float("-inf"))
    return bias.view(-1, 1, 1, keep.shape[-1])


def key_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Eq. 5 for q, k, v of shape (B, H, N, d) and keep of shape (N,) or (B, N), key 0 always kept: attention over
    the kept keys."""
    if not keep.requires_grad:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias(keep, q.dtype))
    m = keep.to(v.dtype).view(-1, 1, keep.shape[-1], 1)  # (1 or B, 1, N, 1)
    d = v.shape[-1]
    scale = d**-0.5
    with torch.no_grad():  # the bias and its compensation are constants: they cancel in the ratio
        bound = q.norm(dim=-1).amax(-1, keepdim=True) * (k - k[..., :1, :]).norm(dim=-1) * scale  # (B, H, N)
        shift = (bound.float() - KEPT_SHARE).clamp_min(0) * (m.squeeze(-1) == 0)
        compensation = shift.clamp_max(MAX_SCALE).exp().to(v.dtype).unsqueeze(-1)
    width = d + 1 + (-(d + 1) % WIDTH_ALIGN)
    gate = m * compensation  # 0 for masked keys: their (huge) value gradient never meets an inf
    values = torch.cat([v * gate, gate.expand(*v.shape[:-1], 1)], dim=-1)
    q, k, values = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, values))
    bias = (-shift).to(q.dtype).unsqueeze(-2)  # (B, H, 1, N)
    out = F.scaled_dot_product_attention(q, k, values, attn_mask=bias, scale=scale)
    return out[..., :d] / out[..., d : d + 1]


POLICY_EPS = 1e-6  # the official softmax_with_policy's eps


def policy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """MEAT's official attention (zju-vipa/MEAT-TIL ``AttentionAll.softmax_with_policy``, DynamicViT's): key j weighs
    keep_j, and 1 where j is the query itself (a masked token still attends to itself); exp(A - max A) times that
    policy, then (w + eps/N) / (sum w + eps), in fp32, on an explicit (B, H, N, N) map."""
    n = keep.shape[-1]
    m = keep.to(torch.float32).view(-1, 1, 1, n)
    policy = m + (1 - m) * torch.eye(n, device=q.device)
    logits = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    w = (logits - logits.amax(-1, keepdim=True)).exp() * policy
    w = (w + POLICY_EPS / n) / (w.sum(-1, keepdim=True) + POLICY_EPS)
    return (w @ v.float()).to(v.dtype)


class KeyMaskedAttention(nn.Module):
    """Wraps a timm ``Attention``: with ``keep`` set (a mask over the patch tokens), the forward pass masks those
    keys (``self_kept``: a masked token still attends to itself, the official code's variant); without it, the wrapped
    module runs unchanged. Parameters stay the wrapped module's."""

    def __init__(self, attn: nn.Module, num_prefix_tokens: int, self_kept: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.num_prefix_tokens = num_prefix_tokens
        self.self_kept = self_kept
        self.keep: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if self.keep is None:
            return self.attn(x, attn_mask=attn_mask, is_causal=is_causal)
        if attn_mask is not None or is_causal:
            raise ValueError("token masks cannot be combined with another attention mask")
        keep = torch.cat([self.keep.new_ones(*self.keep.shape[:-1], self.num_prefix_tokens), self.keep], dim=-1)
        if isinstance(self.attn, RefinerAttention):  # it masks its own explicit attention maps
            return self.attn(x, keep=keep)
        q, k, v, gate = head_split(self.attn, x)
        attend = policy_attention if self.self_kept else key_masked_attention
        return head_merge(self.attn, attend(q, k, v, keep), gate)
