"""Shared base of the weight-mask methods: masked Linears, per-task binary masks, per-task heads.

A subclass decides, per layer and task, which mask multiplies the weight (:meth:`mask_for`); the base
sets those masks before every forward pass, trains only the current head plus what the subclass adds,
stores finished tasks' masks as boolean buffers (counted and saved as packed bits), and reports storage.
These methods are task-conditioned: without a task id they infer it (lowest entropy, or their own rule).
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.base import Logs, Method
from clbench.methods.masking import MASKABLE, MaskedLayer, buffer_name, pack_bits, unpack_bits, wrap_layers


class MaskedMethod(Method):
    task_conditioned = True
    changes_backbone = False
    soft_targets = True

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: Any) -> None:
        super().__init__(backbone, benchmark, config)
        try:
            self.layers: dict[str, MaskedLayer] = wrap_layers(backbone, tuple(config.layers))
        except ValueError as err:
            raise ConfigError(f"Invalid value for `method.layers`: {err}. Allowed: {list(MASKABLE)}.") from None
        self.backbone.requires_grad_(False)

    # ----------------------------------------------------------------------------- masks
    def mask_for(self, name: str, task_id: int) -> torch.Tensor | None:
        """The mask of layer ``name`` for ``task_id`` (``None``: the whole weight)."""
        raise NotImplementedError

    def stored_mask(self, name: str, task_id: int) -> torch.Tensor | None:
        return getattr(self, f"mask_{task_id}_{buffer_name(name)}", None)

    def store_mask(self, name: str, task_id: int, mask: torch.Tensor) -> None:
        self.register_buffer(f"mask_{task_id}_{buffer_name(name)}", mask.detach().bool())

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is None:
            raise ValueError(f"{type(self).__name__} needs a task id to pick its masks")
        for name, layer in self.layers.items():
            layer.mask = self.mask_for(name, task_id)
        try:
            return super().features(x, task_id)
        finally:
            for layer in self.layers.values():
                layer.mask = None  # no reference to a graph outlives the forward pass

    # ----------------------------------------------------------------------------- training
    def param_groups(self, task: Task, phase: Any) -> list[dict[str, Any]]:
        """The current task's head; subclasses add their mask scores or weights."""
        self.backbone.requires_grad_(False)
        for t, head in enumerate(self.heads):
            head.requires_grad_(t == task.id)
        return [{"params": list(self.heads[task.id].parameters())}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """Cross-entropy of the task's own head over the task's classes (task-incremental training)."""
        logits = self.heads[task.id](self.features(x, task.id))
        return self.task_loss(logits, y, task), {}

    # ----------------------------------------------------------------------------- bookkeeping
    def masked_weights(self) -> int:
        return sum(layer.weight.numel() for layer in self.layers.values())

    def mask_bits_per_task(self) -> int:
        """Bits one task's binary masks take, packed: one per masked weight."""
        return self.masked_weights()

    def storage(self) -> dict[str, Any]:
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            if any(self.stored_mask(name, t) is not None for name in self.layers):
                entry["masks"] = self.mask_bits_per_task()
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        """Heads and packed masks of every finished task (what re-evaluating the run needs besides the backbone)."""
        out = super().artifacts()
        for t in range(self.num_seen):
            for name in self.layers:
                saved = self.saved_mask(name, t)
                if saved is not None:
                    out[f"mask.{t}.{name}"] = saved
        return out

    def saved_mask(self, name: str, task_id: int) -> torch.Tensor | None:
        """Task ``task_id``'s mask of layer ``name`` as the artifacts keep it: packed bits."""
        mask = self.stored_mask(name, task_id)
        return None if mask is None else pack_bits(mask)

    def restore_mask(self, name: str, task_id: int, saved: torch.Tensor) -> None:
        """The inverse of :meth:`saved_mask`."""
        weight = self.layers[name].weight
        self.store_mask(name, task_id, unpack_bits(saved.to(weight.device), weight.shape))

    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for t in range(self.num_seen):
            for name in self.layers:
                saved = tensors.get(f"mask.{t}.{name}")
                if saved is not None:
                    self.restore_mask(name, t, saved)


class ScoredMaskMethod(MaskedMethod):
    """Masks learned as real-valued scores per weight, binarised with a straight-through gradient
    (Piggyback: threshold; SupSup: top-k). The current task's scores train; at the end of the task the
    binary mask is stored and the scores are dropped. The backbone never changes."""

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: Any) -> None:
        super().__init__(backbone, benchmark, config)
        self.scores = nn.ParameterDict()  # the current task's scores, one tensor per masked layer

    def init_scores(self, layer: MaskedLayer) -> torch.Tensor:
        raise NotImplementedError

    def binarize(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        """The binary mask of ``scores`` with a straight-through gradient."""
        raise NotImplementedError

    def final_mask(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        """The mask stored when the task ends (MEAT: the noise-free argmax instead of a training sample)."""
        return self.binarize(name, scores)

    def before_task(self, task: Task) -> None:
        super().before_task(task)
        for name, layer in self.layers.items():
            self.scores[buffer_name(name)] = nn.Parameter(self.init_scores(layer))

    def mask_for(self, name: str, task_id: int) -> torch.Tensor | None:
        stored = self.stored_mask(name, task_id)
        if stored is not None:
            return stored
        if task_id == self.num_seen - 1 and buffer_name(name) in self.scores:
            return self.binarize(name, self.scores[buffer_name(name)])
        return None  # a task not started yet: the whole weight

    def param_groups(self, task: Task, phase: Any) -> list[dict[str, Any]]:
        scores: dict[str, Any] = {"params": list(self.scores.values()), "weight_decay": 0.0}
        if self.config.mask_lr is not None:
            scores["lr"] = self.config.mask_lr
        return [*super().param_groups(task, phase), scores]

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        super().after_task(task)
        for name in self.layers:
            self.store_mask(name, task.id, self.final_mask(name, self.scores[buffer_name(name)]))
        self.scores.clear()
