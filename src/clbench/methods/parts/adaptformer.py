"""AdaptFormer's parallel MLP adapter (Chen et al., "AdaptFormer: Adapting Vision Transformers for Scalable Visual
Recognition", NeurIPS 2022), as APER and RanPAC use it (zhoudw-zdw/RevisitingCIL@a2e6b71 and RanPAC/RanPAC@012927f,
``vision_transformer_adapter.py``: ``Adapter`` L31-90 with ``ffn_option="parallel"``, ``ffn_adapter_layernorm_option=
"none"``, ``ffn_adapter_init_option="lora"``, ``ffn_adapter_scalar="0.1"``, dropout 0.1; ``Block.forward`` L165-183).

In each block the adapter reads the residual stream after attention, before the MLP's LayerNorm, and its output is
added beside the MLP's::

    x <- x + attn(LN1(x))
    x <- x + MLP(LN2(x)) + s · (W_up · Drop(ReLU(W_down x + b_down)) + b_up)

with no LayerNorm of its own, W_down Kaiming-uniform (a = sqrt 5), W_up = 0 and both biases 0: the adapted ViT equals
the pretrained one until the first step. 2dr + d + r parameters per block (r = 64, d = 768: 99,136).

In a timm ``Block`` the MLP's norm moves into the MLP's slot: ``block.norm2`` becomes the identity and ``block.mlp``
computes ``mlp(norm2(x)) + adapter(x)``, which timm's block adds to x (through its layer scale and drop path, so a
block with a layer scale is refused: the adapter would be scaled too; drop path, 0 in both codes, covers the sum).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.errors import ConfigError
from clbench.methods.parts.bottleneck import Bottleneck


class AdaptFormer(Bottleneck):
    """s · (W_up · Drop(ReLU(W_down x + b_down)) + b_up), initialised so that it outputs 0."""

    def __init__(
        self,
        dim: int,
        bottleneck: int = 64,
        scale: float = 0.1,
        dropout: float = 0.1,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, bottleneck, F.relu, dropout, device=device, dtype=dtype)
        self.scale = scale
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
            for tensor in (self.up.weight, self.down.bias, self.up.bias):
                nn.init.zeros_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * super().forward(x)


class ParallelAdapterMlp(nn.Module):
    """A block's MLP with its LayerNorm moved in and the adapter beside it: ``mlp(norm(x)) + adapter(x)``; the MLP
    alone while ``active`` is False (bit for bit the pretrained block)."""

    def __init__(self, norm: nn.Module, mlp: nn.Module, adapter: AdaptFormer) -> None:
        super().__init__()
        self.norm = norm
        self.mlp = mlp
        self.adapter = adapter
        self.active = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.norm(x))
        return out + self.adapter(x) if self.active else out


def attach_adaptformer(
    vit: VisionTransformer, bottleneck: int = 64, scale: float = 0.1, dropout: float = 0.1
) -> list[ParallelAdapterMlp]:
    """Give every block of ``vit`` a parallel adapter; returns the wrapped MLPs (their ``adapter`` is trainable)."""
    like = vit.cls_token if vit.cls_token is not None else vit.pos_embed
    wrapped = []
    for i, block in enumerate(vit.blocks):
        if not all(hasattr(block, name) for name in ("norm2", "mlp", "ls2")):
            raise ConfigError(f"Invalid backbone for an AdaptFormer adapter: block {i} is not a timm Block.")
        if not isinstance(block.ls2, nn.Identity):
            raise ConfigError(
                f"Invalid backbone for an AdaptFormer adapter: block {i} has a layer scale, which would scale the "
                "adapter too. Allowed: a ViT without layer scale (init_values=None)."
            )
        adapter = AdaptFormer(vit.embed_dim, bottleneck, scale, dropout, device=like.device, dtype=like.dtype)
        block.mlp = ParallelAdapterMlp(block.norm2, block.mlp, adapter)
        block.norm2 = nn.Identity()
        wrapped.append(block.mlp)
    return wrapped
