"""First-session adaptation: a pretrained ViT adapted on the first task only, then frozen (APER's "adapt", Zhou et al.,
IJCV 2024, §4; RanPAC's Phase 1, McDonnell et al., NeurIPS 2023, §4.2). What both methods share, from their codes
(zhoudw-zdw/RevisitingCIL@a2e6b71 models/aper_*.py ``_train`` / ``_init_train``; RanPAC/RanPAC@012927f RanPAC.py
``_train`` L225-238, ``freeze_backbone`` L178-195):

- a parameter-efficient module attached to the ViT (:mod:`clbench.methods.parts.petl`: AdaptFormer adapters, SSF, deep
  or shallow VPT), or (``finetune``) a trainable copy of the whole ViT beside the frozen pretrained one;
- a cosine head over the first task's classes, sigma · cos(phi(x), w_c) with sigma learnable (``CosineLinear``), thrown
  away after the session;
- cross-entropy over the first task's classes; the optimizer gets the module's (or the copy's) parameters and the head;
- afterwards everything is frozen: later tasks only observe.

Both codes give SGD weight decay to every trained parameter (SSF's scales, biases and sigma included); the methods
keep that (``no_weight_decay_ids`` is empty).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Task
from clbench.methods.base import Logs, Method, Phase
from clbench.methods.parts import petl
from clbench.methods.parts.adaptformer import AdapterConfig
from clbench.methods.parts.cosine import CosineHead


@dataclass
class FirstSessionConfig(AdapterConfig):
    """What the first session adapts and how (both codes' values; the adapter's keys are :class:`AdapterConfig`'s:
    APER's ffn_num 64, RanPAC's hard-coded 64, s 0.1, dropout 0.1)."""

    CHOICES: ClassVar[tuple[str, ...]] = (*petl.KINDS, "finetune")
    petl: str = "adapter"  # adapter | ssf | vpt_deep | vpt_shallow | finetune (the whole ViT, a copy)
    prompts: int = 5  # VPT tokens per set (APER prompt_token_num 5; RanPAC hard-codes 5)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("method.petl", self.petl, self.CHOICES)
        require(isinstance(self.prompts, int) and self.prompts >= 1, "method.prompts", self.prompts, "an integer >= 1")


def vit_features(vit: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """The ViT's pre-logit features (final-norm CLS token, or the pooled patch tokens)."""
    return vit.forward_head(vit.forward_features(x), pre_logits=True)


class FirstSession(nn.Module):
    """The first session's trainable parts on ``backbone`` (which the method owns and freezes): the attached module
    (``petl``) or the trainable copy (``tuned``), and the cosine ``head`` over ``num_classes`` classes."""

    def __init__(self, backbone: VisionTransformer, config: FirstSessionConfig, num_classes: int) -> None:
        super().__init__()
        self.kind = config.petl
        like = backbone.pos_embed
        self.tuned = copy.deepcopy(backbone).requires_grad_(True) if self.kind == "finetune" else None
        self._backbone = (backbone,)  # held, not registered: the method owns the backbone
        self.petl = (
            petl.attach(
                backbone,
                self.kind,
                bottleneck=config.bottleneck,
                scale=config.adapter_scale,
                dropout=config.adapter_dropout,
                tokens=config.prompts,
            )
            if self.kind in petl.KINDS
            else None
        )
        self.head = CosineHead(backbone.num_features, num_classes, device=like.device)

    @property
    def adapted(self) -> VisionTransformer:
        """The ViT the session adapts: the copy, or the backbone with its module."""
        return self.tuned if self.tuned is not None else self._backbone[0]

    def trained(self) -> list[nn.Parameter]:
        """What the session's optimizer updates: the module's (or the copy's) parameters and the head's."""
        own = self.tuned.parameters() if self.tuned is not None else self.petl.parameters() if self.petl else []
        return [*own, *self.head.parameters()]

    def adapted_numel(self) -> int:
        """Parameters the session adapts, the head aside (the module's, or the whole copy's)."""
        if self.tuned is not None:
            return sum(p.numel() for p in self.tuned.parameters())
        return self.petl.numel() if self.petl else 0

    def freeze(self) -> None:
        for p in self.trained():
            p.requires_grad_(False)

    def adapted_features(self, x: torch.Tensor) -> torch.Tensor:
        return vit_features(self.adapted, x)

    def pretrained_features(self, x: torch.Tensor) -> torch.Tensor:
        """The pretrained ViT's features: the backbone with its module switched off (bit for bit the ViT before it
        was attached), or the backbone beside the trained copy."""
        backbone = self._backbone[0]
        if self.petl is None:
            return vit_features(backbone, x)
        with self.petl.off():
            return vit_features(backbone, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The session's training logits: sigma · cos(phi_adapted(x), w_c) over the first task's classes."""
        return self.head(self.adapted_features(x))

    def state(self) -> dict[str, torch.Tensor]:
        """What the session adapted, for a run's artifacts: ``petl.<name>`` or ``tuned.<name>`` tensors."""
        if self.tuned is not None:
            return {f"tuned.{k}": v.detach().clone() for k, v in self.tuned.state_dict().items()}
        return self.petl.state("petl.") if self.petl else {}

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state`'s tensors."""
        if self.tuned is not None:
            tuned = {k.removeprefix("tuned."): v for k, v in tensors.items() if k.startswith("tuned.")}
            self.tuned.load_state_dict(tuned)
        elif self.petl:
            self.petl.load(tensors, "petl.")


class FirstSessionLearner(Method):
    """A method whose only gradient steps are its first session's (``self.first``, a :class:`FirstSession`): the
    module (or the copy) and its cosine head, by cross-entropy over the first task's classes, with weight decay on
    every trained parameter (both codes' SGD)."""

    first: FirstSession

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        return [{"params": self.first.trained()}]

    def no_weight_decay_ids(self) -> set[int]:
        """None: the code's SGD decays every trained parameter (SSF scales, biases, sigma)."""
        return set()

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        return self.task_loss(self.first.logits(x), y, task), {}
