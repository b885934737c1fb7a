"""An independent, plain-PyTorch reference ("oracle") of the three parameter-efficient ViTs APER and RanPAC train,
transcribed from their official code (zhoudw-zdw/RevisitingCIL@a2e6b71 convs/, identical to RanPAC/RanPAC@012927f
petl/): ``vision_transformer_adapter.py`` (``Adapter`` L31-90, ``Block.forward`` L165-183), ``vision_transformer_ssf.py``
(``init_ssf_scale_shift``, ``ssf_ada``, ``Mlp``, ``Attention``, ``Block``, ``PatchEmbed``, ``forward_features``) and
``vpt.py`` (``VPT_ViT.forward_features``). No clbench code and no nn.Module: the ViT's weights are a dict of plain
tensors under timm's names (a timm ViT's state_dict), the modules' parameters plain tensors too.

The ViT (timm's pre-norm ViT, no layer scale, no dropout, evaluation)::

    x = [cls; patches(img)] + pos
    per block:  x = x + attn(LN1(x));  x = x + fc2(GELU(fc1(LN2(x))))
    features = LN(x)[:, 0]            (token pooling; average pooling: fc_norm(mean of the patch tokens))

AdaptFormer, parallel (``ffn_option="parallel"``, ``adapter_layernorm_option="none"``, scalar 0.1)::

    x = x + attn(LN1(x));  adapt = s · (up(ReLU(down(x))));  x = x + (fc2(GELU(fc1(LN2(x)))) + adapt)

SSF: ``ssf_ada(x, scale, shift) = x * scale + shift`` after patch projection, LN1, qkv, attn proj, LN2, fc1, fc2 and
the final LN. VPT: ``n`` prompt tokens concatenated after the tokens, deep: before every block (its own), cut after it;
shallow: once before the first block, cut after the last.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Weights = dict[str, torch.Tensor]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def ssf_ada(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """vision_transformer_ssf.py ``ssf_ada`` (channels last)."""
    return x * scale + shift


Affine = Callable[[str, torch.Tensor], torch.Tensor]  # (site name, tensor) -> tensor: SSF at that site, or identity


def no_ssf(site: str, x: torch.Tensor) -> torch.Tensor:
    return x


def patch_tokens(img: torch.Tensor, w: Weights, patch: int, ssf: Affine = no_ssf) -> torch.Tensor:
    """PatchEmbed: a patch x patch convolution of stride patch, flattened to (B, N, d); SSF after the projection."""
    b, c, h, wd = img.shape
    cols = img.unfold(2, patch, patch).unfold(3, patch, patch)  # B, C, h/p, w/p, p, p
    cols = cols.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // patch) * (wd // patch), c * patch * patch)
    kernel = w["patch_embed.proj.weight"].reshape(len(w["patch_embed.proj.weight"]), -1)
    return ssf("patch", cols @ kernel.T + w["patch_embed.proj.bias"])


def attention(x: torch.Tensor, w: Weights, i: int, heads: int, ssf: Affine = no_ssf) -> torch.Tensor:
    """Attention: qkv (SSF), softmax(q k^T / sqrt(hd)) v, proj (SSF)."""
    b, n, d = x.shape
    qkv = ssf(f"{i}.qkv", x @ w[f"blocks.{i}.attn.qkv.weight"].T + w[f"blocks.{i}.attn.qkv.bias"])
    q, k, v = qkv.reshape(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    attn = torch.softmax(q @ k.transpose(-2, -1) * (d // heads) ** -0.5, dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(b, n, d)
    return ssf(f"{i}.proj", out @ w[f"blocks.{i}.attn.proj.weight"].T + w[f"blocks.{i}.attn.proj.bias"])


def mlp(x: torch.Tensor, w: Weights, i: int, ssf: Affine = no_ssf) -> torch.Tensor:
    """Mlp: fc1 (SSF), GELU, fc2 (SSF)."""
    h = gelu(ssf(f"{i}.fc1", x @ w[f"blocks.{i}.mlp.fc1.weight"].T + w[f"blocks.{i}.mlp.fc1.bias"]))
    return ssf(f"{i}.fc2", h @ w[f"blocks.{i}.mlp.fc2.weight"].T + w[f"blocks.{i}.mlp.fc2.bias"])


def norm(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    return layer_norm(x, w[f"{name}.weight"], w[f"{name}.bias"])


def block(x: torch.Tensor, w: Weights, i: int, heads: int, ssf: Affine = no_ssf) -> torch.Tensor:
    """The SSF Block.forward (without SSF: the plain pre-norm block)."""
    x = x + attention(ssf(f"{i}.norm1", norm(x, w, f"blocks.{i}.norm1")), w, i, heads, ssf)
    return x + mlp(ssf(f"{i}.norm2", norm(x, w, f"blocks.{i}.norm2")), w, i, ssf)


def adapter_block(x: torch.Tensor, w: Weights, i: int, heads: int, adapter: dict[str, torch.Tensor]) -> torch.Tensor:
    """vision_transformer_adapter.py Block.forward, ffn_option "parallel", evaluation (no dropout)."""
    x = x + attention(norm(x, w, f"blocks.{i}.norm1"), w, i, heads)
    down = torch.relu(x @ adapter["down.weight"].T + adapter["down.bias"])
    adapt_x = (down @ adapter["up.weight"].T + adapter["up.bias"]) * adapter["scale"]
    residual = x
    x = mlp(norm(x, w, f"blocks.{i}.norm2"), w, i)
    x = x + adapt_x
    return residual + x


def embed(img: torch.Tensor, w: Weights, patch: int, ssf: Affine = no_ssf) -> torch.Tensor:
    tokens = patch_tokens(img, w, patch, ssf)
    cls = w["cls_token"].expand(len(img), -1, -1)
    return torch.cat([cls, tokens], dim=1) + w["pos_embed"]


def pool(x: torch.Tensor, w: Weights, avg: bool, ssf: Affine = no_ssf) -> torch.Tensor:
    """Token pooling: SSF(LN(x))[:, 0] (forward_features then forward_head); average pooling: the patch tokens'
    mean through fc_norm (and SSF on it: the final norm's)."""
    if avg:
        return ssf("final", norm(x[:, 1:].mean(dim=1), w, "fc_norm"))
    return ssf("final", norm(x, w, "norm"))[:, 0]


def features(
    img: torch.Tensor,
    w: Weights,
    *,
    depth: int,
    heads: int,
    patch: int,
    avg: bool = False,
    ssf: Affine = no_ssf,
    adapters: list[dict[str, torch.Tensor]] | None = None,
    prompts: list[torch.Tensor] | None = None,
    deep: bool = True,
) -> torch.Tensor:
    """The ViT's features with at most one of SSF (``ssf``), adapters (one dict per block: down/up weight and bias,
    scale) and VPT prompts (deep: one (n, d) tensor per block; shallow: one)."""
    x = embed(img, w, patch, ssf)
    if prompts is not None and not deep:
        n = len(prompts[0])
        x = torch.cat([x, prompts[0].expand(len(x), -1, -1)], dim=1)
    for i in range(depth):
        if prompts is not None and deep:
            n = len(prompts[i])
            x = torch.cat([x, prompts[i].expand(len(x), -1, -1)], dim=1)
            x = block(x, w, i, heads)[:, : x.shape[1] - n]
        elif adapters is not None:
            x = adapter_block(x, w, i, heads, adapters[i])
        else:
            x = block(x, w, i, heads, ssf)
    if prompts is not None and not deep:
        x = x[:, : x.shape[1] - n]
    return pool(x, w, avg, ssf)


def adapter_params(d: int, r: int) -> int:
    """One AdaptFormer adapter: down (d x r + r) and up (r x d + d)."""
    return 2 * d * r + r + d


def ssf_params(d: int, hidden: int, depth: int) -> int:
    """Scale and shift at qkv (3d), proj (d), fc1 (hidden), fc2 (d), norm1, norm2 (d each) per block, and at the
    patch projection and the final norm (d each)."""
    return depth * 2 * (3 * d + d + hidden + d + d + d) + 2 * 2 * d
