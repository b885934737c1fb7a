"""InfLoRA, Interference-free Low-Rank Adaptation (Liang and Li, "InfLoRA: Interference-Free Low-Rank Adaptation for
Continual Learning", CVPR 2024): a frozen pretrained ViT whose k and v projections take one low-rank update a task,
B_t A_t, with A_t designed before training so that the update cannot reach the subspace of the earlier tasks' inputs,
and only B_t (and the task's head) trained. Official code liangyanshuo/InfLoRA@e08b00e (methods/inflora.py,
models/vit_inflora.py, models/sinet_inflora.py, configs/*_inflora.json).

Each task t, per block (every one of the ViT's; :mod:`clbench.methods.parts.lora` on k and v, rank r = 10):

1. ``design``: one pass over the task's training images (augmented, as the code's ``train_loader``) records the
   second moment M = (1/n) Σ x x^T of the attention's input over every token (vit_inflora.py L236-238); A_t = a_scale
   · (the first r left singular vectors of the part of M the earlier tasks' subspace leaves free)^T, the same for k and
   v (inflora.py L116-158; a_scale = 1/√3, the code's constant);
2. ``train``: B_t (k and v, from 0) and head t by cross-entropy over the task's classes (L93-108, L211-245);
   W_k = W_k⁰ + Σ_{s<=t} B_s^k A_s, the same for v (vit_inflora.py L245-249);
3. ``subspace``: a second pass records M again through the trained model (L188-198) and the layer's DualGPM grows
   with it at ε_t = λ_b + (λ_e − λ_b) t / T (L321-412; :mod:`clbench.methods.parts.dualgpm`).

CIL: argmax over every seen task's head on one forward of the ViT with every update (``interface``,
sinet_inflora.py L122-133; the heads are ``classifier_pool``, nn.Linear's default init, L74-77).

``subspace_pass: before`` grows the subspace from the design pass's M instead (the inputs before B_t was trained): one
pass a task fewer; the code's ``after`` is the default, the subspace the trained model's inputs span being the one
later tasks must keep clear of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.methods.base import Logs, Method, Phase
from clbench.methods.parts import lora
from clbench.methods.parts.dualgpm import Subspace, energy_threshold


@dataclass
class InfLoRAConfig:
    rank: int = 10  # r of every k and v update (configs: rank 10)
    lamb: float = 0.95  # λ_b, the first task's energy threshold (cifar100_inflora.json 0.95; ImageNet-R 0.98)
    lame: float = 1.0  # λ_e, the threshold's end (every config: 1.0)
    a_scale: float = 1 / math.sqrt(3)  # A_t = a_scale · U_r^T (inflora.py L127-128, L154-155: / math.sqrt(3))
    subspace_pass: str = "after"  # after: a second pass through the trained model (code) | before: the design pass's

    def __post_init__(self) -> None:
        require(isinstance(self.rank, int) and self.rank >= 1, "method.rank", self.rank, "an integer >= 1")
        require(0 < self.lamb <= 1, "method.lamb", self.lamb, "a float in (0, 1]")
        require(self.lamb <= self.lame <= 1, "method.lame", self.lame, f"a float in [method.lamb={self.lamb}, 1]")
        require(self.a_scale > 0, "method.a_scale", self.a_scale, "> 0")
        require_choice("method.subspace_pass", self.subspace_pass, ("after", "before"))


class InfLoRA(Method):
    """Per-task heads over the LoRA-adapted ViT's features; ``subspaces[l]`` is block l's DualGPM."""

    Config = InfLoRAConfig
    changes_backbone = False  # the pretrained weights never change; the components are saved on their own

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: InfLoRAConfig) -> None:
        super().__init__(backbone, benchmark, config)
        backbone.requires_grad_(False)
        device, slots = backbone.pos_embed.device, len(self.tasks)
        ones = lora.Magnitudes(slots, init=1.0, trainable=False, device=device)
        self.lora = lora.attach(backbone, ("k", "v"), config.rank, slots, ones)
        self.magnitudes = ones
        for wrapper in self.lora.wrappers:
            wrapper.a.requires_grad_(False)  # A is designed, not trained
        self.subspaces = nn.ModuleList(Subspace(backbone.embed_dim, device) for _ in self.lora.wrappers)
        # per task and block: the subspace's size after the task, negative where it is kept as its complement
        self.register_buffer("sizes", torch.zeros(slots, len(self.lora.wrappers), dtype=torch.long, device=device))

    def before_task(self, task: Task) -> None:
        """The previous task's component joins the bank (weight 1: the sum of every B_s A_s); a fresh one starts."""
        super().before_task(task)
        if task.id:
            self.lora.advance(task.id - 1, [torch.ones_like(w.bank_gain[0]) for w in self.lora.wrappers])

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        design = Phase("design", 1, observe=True, augment=True)
        later = [Phase("subspace", 1, observe=True, augment=True)] if self.config.subspace_pass == "after" else []
        return [design, Phase("train", epochs), *later]

    def before_phase(self, task: Task, phase: Phase) -> None:
        if phase.observe:
            self.lora.recording = True  # zeroes the moments
        elif phase.name == "train":
            self.lora.recording = False
            self.design(task)

    @torch.no_grad()
    def design(self, task: Task) -> None:
        """A_t of every block from the design pass (a task walked through without data keeps its A: the loaded
        checkpoint's)."""
        for wrapper, subspace in zip(self.lora.wrappers, self.subspaces, strict=True):
            moment = wrapper.mean_moment()
            if moment is None:
                continue
            a = subspace.design(moment, self.config.rank, self.config.a_scale)
            wrapper.a.copy_(a.to(wrapper.a.dtype).expand_as(wrapper.a))

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """The pass's forward records every block's input moment (the features themselves are not needed)."""
        self.features(x, task.id)

    def observations(self) -> list[torch.Tensor]:
        return [t for w in self.lora.wrappers if w.recording for t in (w.moment, w.tokens)]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """B_t of every block (k and v) and the task's head (the code's Adam sees every parameter; only these have
        gradients)."""
        return [{"params": [*(w.b for w in self.lora.wrappers), *self.heads[task.id].parameters()]}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        return self.task_loss(self.task_logits(x, task.id), y, task), {}

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """Grow every block's DualGPM with the task's moment (``update_DualGPM``); a task walked through without data
        (a checkpoint's replay, the random-init probe) changes nothing."""
        self.lora.recording = False
        threshold = energy_threshold(task.id, len(self.tasks), self.config.lamb, self.config.lame)
        for i, (wrapper, subspace) in enumerate(zip(self.lora.wrappers, self.subspaces, strict=True)):
            moment = wrapper.mean_moment()
            if moment is None:
                continue
            subspace.update(moment, threshold)
            self.sizes[task.id, i] = -subspace.size if subspace.retain else subspace.size

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: its head and its k/v component over every block (32-bit). Shared: every block's DualGPM basis,
        kept for training only (64-bit, d x d buffers)."""
        component = 32 * self.lora.numel_per_component()
        per_task = [{"head": 32 * sum(p.numel() for p in h.parameters()), "lora": component} for h in self.heads]
        shared = {"dualgpm_basis": sum(64 * s.basis.numel() for s in self.subspaces)}
        return {"bits_per_task": per_task, "shared_bits": shared, "trainable_params": self.trained_numel()}

    def trained_numel(self) -> int:
        """What a task trains: B of every block and one head."""
        heads = sum(p.numel() for p in self.heads[-1].parameters()) if self.num_seen else 0
        return sum(w.b.numel() for w in self.lora.wrappers) + heads

    def extra_results(self) -> dict[str, Any]:
        """Per task: ε_t and every block's subspace after it (its dimension, negative where kept as its
        complement, of that dimension)."""
        tasks = len(self.tasks)
        lamb, lame = self.config.lamb, self.config.lame
        return {
            "inflora": {
                "threshold_per_task": [energy_threshold(t, tasks, lamb, lame) for t in range(self.num_seen)],
                "subspace_size_per_task": self.sizes[: self.num_seen].tolist(),
            }
        }

    def artifacts(self) -> dict[str, torch.Tensor]:
        return super().artifacts() | self.lora.state("lora.")

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.lora.load(tensors, "lora.")
