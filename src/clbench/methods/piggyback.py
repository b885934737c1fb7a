"""Piggyback (Mallya, Davis & Lazebnik, ECCV 2018): learn a binary mask per task over fixed pretrained weights.

Each masked layer gets real-valued scores M_r (init ``init_scale`` = 1e-2 everywhere, so training starts from
the full network); the forward pass uses W * 1[M_r > ``threshold``] (5e-3) and the gradient reaches M_r
through a straight-through estimator. After the task the binary mask is stored (1 bit per weight) and
the scores are dropped. The backbone (weights, biases, LayerNorms, embeddings) never changes.

ViT adaptation: masks on ``attn.qkv``, ``attn.proj``, ``mlp.fc1`` and ``mlp.fc2`` of every block, exactly the
"Piggyback" baseline of MEAT's Table 1 (masks on all block weights); add ``patch_embed.proj`` to ``layers``
to mask the patch embedding as well. Paper recipe: Adam, lr 1e-4 for masks
and classifier, 30 epochs, batch 32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clbench.config import require, require_choice
from clbench.methods.masked_method import ScoredMaskMethod
from clbench.methods.masking import DEFAULT_TARGETS, MaskedLayer, threshold_mask


@dataclass
class PiggybackConfig:
    threshold: float = 5e-3  # binariser threshold (paper: DEFAULT_THRESHOLD)
    init_scale: float = 1e-2  # mask_scale: initial score value
    mask_init: str = "ones"  # ones: all scores = init_scale | uniform: U(-init_scale, init_scale)
    mask_lr: float | None = None  # learning rate of the scores (null: trainer.lr, as the paper uses one lr)
    layers: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self) -> None:
        require(self.init_scale > 0, "method.init_scale", self.init_scale, "a float > 0")
        require_choice("method.mask_init", self.mask_init, ("ones", "uniform"))
        require(self.mask_lr is None or self.mask_lr > 0, "method.mask_lr", self.mask_lr, "null or a float > 0")


class Piggyback(ScoredMaskMethod):
    Config = PiggybackConfig

    def init_scores(self, layer: MaskedLayer) -> torch.Tensor:
        if self.config.mask_init == "ones":
            return torch.full_like(layer.weight, self.config.init_scale)
        return torch.empty_like(layer.weight).uniform_(-self.config.init_scale, self.config.init_scale)

    def binarize(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        return threshold_mask(scores, self.config.threshold)
