"""AdaptFormer's parallel MLP adapter (Chen et al., "AdaptFormer: Adapting Vision Transformers for Scalable Visual
Recognition", NeurIPS 2022), as APER, RanPAC and EASE use it (zhoudw-zdw/RevisitingCIL@a2e6b71 and
RanPAC/RanPAC@012927f ``vision_transformer_adapter.py``: ``Adapter`` L31-90 with ``ffn_option="parallel"``,
``ffn_adapter_layernorm_option="none"``, ``ffn_adapter_init_option="lora"``, ``ffn_adapter_scalar="0.1"``, dropout
0.1; ``Block.forward`` L165-183; sun-hailong/CVPR24-Ease@6d67508 backbone/vit_ease.py ``Adapter`` L31-90, ``Block``
L155-178, the same module).

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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require
from clbench.errors import ConfigError
from clbench.methods.parts.bottleneck import Bottleneck


@dataclass
class AdapterConfig:
    """An AdaptFormer adapter's settings, as a method's config carries them (APER's, RanPAC's and EASE's codes:
    ``ffn_num``, ``ffn_adapter_scalar`` "0.1", ``Adapter(dropout=0.1)``)."""

    bottleneck: int = 64  # r (ffn_num)
    adapter_scale: float = 0.1  # s (ffn_adapter_scalar "0.1")
    adapter_dropout: float = 0.1  # dropout on the bottleneck, in training only

    def __post_init__(self) -> None:
        require(isinstance(self.bottleneck, int) and self.bottleneck >= 1, "method.bottleneck", self.bottleneck,
                "an integer >= 1")  # fmt: skip
        require(self.adapter_scale > 0, "method.adapter_scale", self.adapter_scale, "> 0")
        require(0 <= self.adapter_dropout < 1, "method.adapter_dropout", self.adapter_dropout, "in [0, 1)")


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
    alone while ``active`` is False (bit for bit the pretrained block). ``adapter``: an :class:`AdaptFormer`, or a
    module that runs one of several (:class:`~clbench.methods.parts.adapter_sets.AdapterBank`)."""

    def __init__(self, norm: nn.Module, mlp: nn.Module, adapter: nn.Module) -> None:
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
    return wrap_blocks(vit, lambda: new_adapter(vit, bottleneck, scale, dropout))


def new_adapter(vit: VisionTransformer, bottleneck: int, scale: float, dropout: float) -> AdaptFormer:
    """A fresh AdaptFormer for one block of ``vit``, on the ViT's device and in its dtype."""
    like = vit.cls_token if vit.cls_token is not None else vit.pos_embed
    return AdaptFormer(vit.embed_dim, bottleneck, scale, dropout, device=like.device, dtype=like.dtype)


def wrap_blocks(vit: VisionTransformer, make: Callable[[], nn.Module]) -> list[ParallelAdapterMlp]:
    """Wrap every block's MLP of ``vit`` as :class:`ParallelAdapterMlp` with ``make()`` beside it (an adapter, or a
    module choosing among several); a block that is not a timm ``Block``, or has a layer scale, is refused."""
    wrapped = []
    for i, block in enumerate(vit.blocks):
        if not all(hasattr(block, name) for name in ("norm2", "mlp", "ls2")):
            raise ConfigError(f"Invalid backbone for an AdaptFormer adapter: block {i} is not a timm Block.")
        if not isinstance(block.ls2, nn.Identity):
            raise ConfigError(
                f"Invalid backbone for an AdaptFormer adapter: block {i} has a layer scale, which would scale the "
                "adapter too. Allowed: a ViT without layer scale (init_values=None)."
            )
        block.mlp = ParallelAdapterMlp(block.norm2, block.mlp, make())
        block.norm2 = nn.Identity()
        wrapped.append(block.mlp)
    return wrapped
