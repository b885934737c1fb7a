"""APER, AdaPt and mERge (Zhou, Cai, Ye, Zhan, Liu, "Revisiting Class-Incremental Learning with Pre-Trained Models:
Generalizability and Adaptivity are All You Need", IJCV 2024; arXiv 2303.07338, first named ADAM): SimpleCIL's
prototype classifier over the pretrained ViT's features concatenated with those of a copy adapted on the first task.
Official code zhoudw-zdw/RevisitingCIL@a2e6b71 (models/aper_{adapter,ssf,vpt,finetune}.py, utils/inc_net.py,
exps/aper_*/*.json, logs/aper_*).

Task 0 (``_train``, ``_init_train``): the ViT is adapted (:mod:`clbench.methods.first_session`: ``petl`` adapter, SSF,
deep or shallow VPT, or ``finetune``, the whole ViT) with a sigma-scaled cosine head over the task's classes,
cross-entropy, SGD with a cosine schedule. Then the merge (``construct_dual_branch_network``, inc_net.py L628-650): a
fresh pretrained ViT beside the adapted one, both frozen, phi_APER(x) = [phi_PTM(x); phi_adapted(x)] (concatenated,
neither branch normalised). Here the pretrained branch is the same ViT with its module switched off, which computes
the pretrained ViT bit for bit (the finetune variant keeps a trained copy beside the frozen backbone).

Every task (``replace_fc``, one pass over its training images through the test transform): the prototype of each new
class is the mean of phi_APER over its images, in row c of a cosine classifier (SimpleCIL's); old rows never change,
so task-incremental forgetting is exactly 0. Task 0's prototypes are taken after the merge. CIL: argmax over the seen
classes of cos(phi_APER(x), p_c) (the code's sigma of the merged head is 1); two ViT forwards per test image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.data import Benchmark, Task
from clbench.methods.base import Phase
from clbench.methods.first_session import FirstSession, FirstSessionConfig, FirstSessionLearner
from clbench.methods.simplecil import SimpleCIL


@dataclass
class APERConfig(FirstSessionConfig):
    """petl: adapter (aper_adapter) | ssf (aper_ssf) | vpt_deep, vpt_shallow (aper_vpt, ``vpt_type``) | finetune
    (aper_finetune)."""


class APER(FirstSessionLearner, SimpleCIL):
    """``heads[t].weight`` holds task ``t``'s prototypes of phi_APER (2d wide); ``features`` is phi_APER."""

    Config = APERConfig

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: APERConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.first = FirstSession(backbone, config, benchmark.tasks[0].num_classes)

    def new_head(self, num_classes: int) -> nn.Linear:
        """Prototypes over the concatenated features (2d)."""
        return nn.Linear(2 * self.backbone.num_features, num_classes, device=self.backbone.pos_embed.device)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        """Task 0: adapt, then its prototypes (after the merge); later tasks: prototypes only."""
        return [Phase("adapt", epochs), *super().phases(task, epochs)] if task.id == 0 else super().phases(task, epochs)

    def before_phase(self, task: Task, phase: Phase) -> None:
        if phase.observe:
            self.first.freeze()  # the merged network is frozen
            super().before_phase(task, phase)

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """phi_APER(x) = [phi_PTM(x); phi_adapted(x)]."""
        return torch.cat([self.first.pretrained_features(x), self.first.adapted_features(x)], dim=1)

    def forwards_per_test_image(self) -> dict[str, int]:
        """Two ViT forwards (pretrained and adapted branch) for either scenario."""
        return {"til": 2, "cil": 2}

    def storage(self) -> dict[str, Any]:
        """SimpleCIL's prototypes (2d floats per class) per task; shared, the adapted module (or the whole trained
        copy of the ViT for finetune), 32-bit. Trainable: what the first session trained, its head included."""
        out = super().storage()
        out["shared_bits"] = {"adapted_module": 32 * self.first.adapted_numel()}
        out["trainable_params"] = sum(p.numel() for p in self.first.trained())
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        return super().artifacts() | self.first.state()

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.first.load(tensors)
        self.first.freeze()
