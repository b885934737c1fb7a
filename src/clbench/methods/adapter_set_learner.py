"""A method over a frozen pretrained ViT that trains AdaptFormer adapter sets beside it, a set per task or more (EASE,
MOS, TUNA): the ViT's own weights never change, so a run saves the sets (``adapters.<set>.<block>.<name>``), not the
backbone, and a finished run's folder loads them back (:mod:`clbench.methods.parts.adapter_sets`)."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from clbench.data import Benchmark
from clbench.methods.base import Method
from clbench.methods.parts.adapter_sets import AdapterSets
from clbench.methods.parts.adaptformer import AdapterConfig


class AdapterSetLearner(Method):
    """The frozen ViT and its adapter sets (``sets``), saved and loaded with the method's other artifacts."""

    changes_backbone = False  # the pretrained weights never change; the adapter sets are saved on their own

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: AdapterConfig) -> None:
        super().__init__(backbone, benchmark, config)
        backbone.requires_grad_(False)
        self.sets = AdapterSets(backbone, config)

    def artifacts(self) -> dict[str, torch.Tensor]:
        return super().artifacts() | self.sets.state("adapters.")

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.sets.load(tensors, "adapters.")
