"""SupSup (Wortsman et al., NeurIPS 2020): supermasks in superposition over fixed weights.

Each task learns edge-popup scores per masked layer (kaiming-uniform init); the forward pass keeps the
top ``density`` fraction of |scores| per layer (straight-through gradient) and uses W * mask. After the task
the binary mask is stored (1 bit per weight); W never changes.

- GG (task id given, TIL): the task's mask and head.
- GN (no task id, CIL): the task is inferred per sample from the superposition W * sum_i alpha_i M_i with
  alpha_i = 1/k: ``inference=one_shot`` picks argmin_i dH/dalpha_i (Eq. 4), ``inference=binary`` halves
  the candidate tasks log2(k) times with the same gradient. H is the entropy of the softmax over all seen
  classes (the concatenated per-task heads); each sample has its own alpha, so nothing depends on the batch.
  ``inference=lowest_entropy`` runs every task's mask and keeps the lowest entropy (k passes, no gradient).

ViT adaptation (design choices): masks on ``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``.
Add ``patch_embed.proj`` to ``layers`` to mask the patch embedding too.
``base_weights=signed_constant`` (the paper) replaces those weights by sign(w0) * sqrt(2 / fan_in) with
w0 ~ N(0, 1) and zeroes their biases; ``pretrained`` keeps the backbone's weights (Piggyback with top-k).
LayerNorms, embeddings and the patch embedding stay as the backbone has them and are frozen (the analogue
of the paper's non-affine norms; a per-task LayerNorm is not used).
``er_scale`` switches to the Erdos-Renyi budget of the official code (``er_sparsity``): density = min(0.5, er_scale *
(c_out + c_in) / (c_out * c_in * kh * kw)): for the optional ``patch_embed.proj`` the kernel area counts in the
denominator only (clbench counted it in both before, keeping 2 to 5 times more of those weights than the official
formula); a Linear has kh = kw = 1. ``score_decay`` is the weight decay on the scores: the official SplitCIFAR-100 run
uses Adam's 1e-4 (the SplitImageNet one 0, the default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Task
from clbench.errors import ConfigError
from clbench.methods.base import Logs
from clbench.methods.masked_method import ScoredMaskMethod
from clbench.methods.masking import DEFAULT_TARGETS, MaskedLayer, threshold_mask, topk_mask


def signed_constant(weight: torch.Tensor) -> torch.Tensor:
    """The paper's fixed weights: sign(w0) sqrt(2 / fan_in), w0 ~ N(0, 1) (the code's ``signed_constant``)."""
    return torch.randn_like(weight).sign() * math.sqrt(2.0 / weight[0].numel())


@dataclass
class SupSupConfig:
    density: float = 0.5  # fraction of weights each task's mask keeps, per layer
    er_scale: float | None = None  # Erdos-Renyi budget scale s (paper: 1..32); null: uniform density
    base_weights: str = "signed_constant"  # signed_constant (paper) | pretrained
    inference: str = "one_shot"  # task inference without task id: one_shot | binary | lowest_entropy (every path)
    mask_lr: float | None = None  # learning rate of the scores (null: trainer.lr)
    score_decay: float = 0.0  # weight decay on the scores (official SplitCIFAR-100: 1e-4; SplitImageNet: 0)
    head: str = "per_task"  # per_task: a trained Linear a task | masked: one fixed output layer, a supermask a task
    outputs: int | None = None  # head=masked: output neurons (null: the most classes of a task; more: superfluous)
    mask_rule: str = "topk"  # topk: edge-popup's top-|S| (GG) | threshold: 1[S > 0] (the GN training's)
    objective: str = "entropy"  # task inference: entropy H | superfluous: G, logsumexp with the real logits detached
    layers: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self) -> None:
        require(0 < self.density <= 1, "method.density", self.density, "a float in (0, 1]")
        require(self.er_scale is None or self.er_scale > 0, "method.er_scale", self.er_scale, "null or > 0")
        require_choice("method.base_weights", self.base_weights, ("signed_constant", "pretrained"))
        require_choice("method.inference", self.inference, ("one_shot", "binary", "lowest_entropy"))
        require(self.mask_lr is None or self.mask_lr > 0, "method.mask_lr", self.mask_lr, "null or a float > 0")
        require(self.score_decay >= 0, "method.score_decay", self.score_decay, "a float >= 0")
        require_choice("method.head", self.head, ("per_task", "masked"))
        require(self.outputs is None or self.outputs >= 1, "method.outputs", self.outputs, "null or an integer >= 1")
        require_choice("method.mask_rule", self.mask_rule, ("topk", "threshold"))
        require_choice("method.objective", self.objective, ("entropy", "superfluous"))
        superfluous = self.head == "masked" and self.outputs is not None
        require(
            self.objective == "entropy" or superfluous,
            "method.objective",
            self.objective,
            "entropy, or superfluous with method.head=masked and method.outputs above the classes of a task",
        )


class SupermaskHead(nn.Module):
    """Task t's share of the masked output layer: its scores while it trains, its binary mask after."""

    def __init__(self, scores: torch.Tensor, num_classes: int) -> None:
        super().__init__()
        self.out_features = num_classes
        self.scores: nn.Parameter | None = nn.Parameter(scores)

    def finish(self, mask: torch.Tensor) -> None:
        del self.scores
        self.scores = None
        self.register_buffer("mask", mask.detach().bool())


class SupSup(ScoredMaskMethod):
    Config = SupSupConfig

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if self.config.base_weights == "signed_constant":
            with torch.no_grad():
                for layer in self.layers.values():
                    layer.weight.copy_(signed_constant(layer.weight))
                    if layer.bias is not None:
                        layer.bias.zero_()
        if self.config.head == "masked":
            classes = max(task.num_classes for task in self.tasks)
            outputs = self.config.outputs or classes
            if outputs < classes:
                raise ConfigError(f"Invalid value for `method.outputs`: {outputs}. Allowed: at least {classes}.")
            weight = self.backbone.cls_token.new_empty(outputs, self.backbone.num_features)
            self.register_buffer("output_weight", signed_constant(weight))  # fixed, as every masked weight

    def density(self, layer: MaskedLayer) -> float:
        """The share of the layer's weights its mask keeps: ``density``, or the official ER budget
        min(0.5, s (c_out + c_in) / (c_out c_in kh kw))."""
        if self.config.er_scale is None:
            return self.config.density
        out_f, in_channels = layer.weight.shape[0], layer.weight.shape[1]
        return min(0.5, self.config.er_scale * (out_f + in_channels) / (out_f * layer.fan_in))

    def param_groups(self, task: Any, phase: Any) -> list[dict[str, Any]]:
        groups = super().param_groups(task, phase)
        groups[-1]["weight_decay"] = self.config.score_decay  # the scores' group
        return groups

    def init_scores(self, layer: MaskedLayer) -> torch.Tensor:
        scores = torch.empty_like(layer.weight)
        nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
        return scores

    def binarize(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        return self.supermask(scores, self.density(self.layers[name]))

    def supermask(self, scores: torch.Tensor, density: float) -> torch.Tensor:
        """Edge-popup's top-|S| at ``density`` (GG) or the GN training's 1[S > 0], straight-through."""
        return topk_mask(scores, density) if self.config.mask_rule == "topk" else threshold_mask(scores, 0.0)

    # ----------------------------------------------------------------------------- head=masked
    def add_head(self, num_classes: int) -> nn.Module:
        if self.config.head == "per_task":
            return super().add_head(num_classes)
        scores = torch.empty_like(self.output_weight)
        nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
        head = SupermaskHead(scores, num_classes)
        self.heads.append(head)
        return head

    def restore_head(self, saved: dict[str, torch.Tensor]) -> None:
        if self.config.head == "per_task":
            super().restore_head(saved)
        else:
            self.add_head(int(saved["out_features"])).finish(saved["mask"].to(self.output_weight.device))

    def output_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        """Every output neuron of the masked output layer under task ``task_id``'s mask (superfluous ones too)."""
        head = self.heads[task_id]
        mask = head.mask if head.scores is None else self.supermask(head.scores, self.config.density)
        return F.linear(feats, self.output_weight * mask.to(self.output_weight.dtype))

    def head_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        if self.config.head == "per_task":
            return super().head_logits(feats, task_id)
        return self.output_logits(feats, task_id)[:, : self.heads[task_id].out_features]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """With a masked output layer, cross-entropy over all its neurons: the superfluous ones learn to stay low."""
        if self.config.head == "per_task":
            return super().training_loss(x, y, task)
        logits = self.output_logits(self.features(x, task.id), task.id)
        if y.is_floating_point():  # soft targets over the task's classes: none on the superfluous neurons
            y = F.pad(y, (0, logits.shape[1] - y.shape[1]))
        return self.task_loss(logits, y, task), {}

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        if self.config.head == "masked":
            head = self.heads[task.id]
            head.finish(self.supermask(head.scores, self.config.density))
        super().after_task(task)

    def artifacts(self) -> dict[str, torch.Tensor]:
        out = super().artifacts()
        if self.config.head == "masked":
            out |= {f"head.{t}.out_features": torch.tensor(h.out_features) for t, h in enumerate(self.heads)}
        return out

    def forwards_per_test_image(self) -> dict[str, int]:
        """TIL: the given task's mask, one pass. CIL (:meth:`predict`), with k seen tasks: lowest_entropy, one pass a
        mask (k); one_shot, one superposed pass (k mask products a layer, and its backward for dH/dalpha), then the
        inferred task's pass (2; 1 with one task); binary, ceil(log2 k) superposed passes, then that pass."""
        k = self.num_seen
        if self.config.inference == "lowest_entropy":
            return {"til": 1, "cil": k}
        superposed = int(k >= 2) if self.config.inference == "one_shot" else (k - 1).bit_length()  # ceil(log2 k)
        return {"til": 1, "cil": superposed + 1}

    def storage(self) -> dict[str, Any]:
        out = super().storage()
        if self.config.head == "masked":  # the head's mask: one bit a weight of the shared output layer
            for entry in out["bits_per_task"]:
                entry["head"] = self.output_weight.numel()
        return out

    # ----------------------------------------------------------------------------- GN: task inference
    def _entropy_grad(self, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """dH/dalpha per sample, H = entropy of the softmax over all seen classes under the superposition."""
        alpha = alpha.detach().requires_grad_(True)
        for name, layer in self.layers.items():
            layer.superposed = torch.stack([self.mask_for(name, t) for t in range(self.num_seen)])
            layer.alpha = alpha
        try:
            with torch.enable_grad():
                feats = self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)
                (grad,) = torch.autograd.grad(self.inference_objective(feats, alpha), alpha)
        finally:
            for layer in self.layers.values():
                layer.superposed = layer.alpha = None
        return grad

    def inference_objective(self, feats: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """What the task inference descends, summed over the samples: the entropy H of the softmax over all seen
        classes (per-task heads, concatenated) or over the real neurons of the superposed masked output layer; or
        (``objective=superfluous``) G = logsumexp of its neurons with the real ones detached."""
        if self.config.head == "per_task":
            logits = self.seen_logits(feats).float()
            real = logits.shape[1]
        else:  # a Linear is linear in its mask: the superposed layer is the alpha-weighted sum of the tasks' outputs
            logits = sum(alpha[:, t, None] * self.output_logits(feats, t) for t in range(self.num_seen)).float()
            real = max(h.out_features for h in self.heads)
        if self.config.objective == "superfluous":
            return torch.logsumexp(torch.cat([logits[:, :real].detach(), logits[:, real:]], 1), 1).sum()
        logp = F.log_softmax(logits[:, :real], dim=1)
        return -(logp.exp() * logp).sum()

    def infer_task(self, x: torch.Tensor) -> torch.Tensor:
        """The inferred task of each sample (one-shot or binary search over the seen tasks' masks)."""
        b, k = x.shape[0], self.num_seen
        candidates = torch.ones(b, k, dtype=torch.bool, device=x.device)
        while True:
            alpha = candidates.float() / candidates.sum(1, keepdim=True)
            grad = self._entropy_grad(x, alpha).masked_fill(~candidates, float("inf"))
            n = int(candidates.sum(1).max())
            if self.config.inference == "one_shot" or n <= 2:
                return grad.argmin(1)
            keep = grad.argsort(1)[:, : math.ceil(n / 2)]
            candidates = torch.zeros_like(candidates).scatter_(1, keep, True) & candidates

    @torch.no_grad()
    def predict(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """GG with a task id; GN without: infer each sample's task, then use that task's mask and head."""
        if task_id is not None:
            return self.task_logits(x, task_id)
        if self.config.inference == "lowest_entropy":  # k forward passes, one a mask: the paper's exhaustive baseline
            return self.lowest_entropy_task(self.every_task_logits(x))
        tasks = self.infer_task(x) if self.num_seen > 1 else torch.zeros(len(x), dtype=torch.long, device=x.device)
        out = x.new_full((len(x), sum(h.out_features for h in self.heads)), float("-inf"))
        for t in tasks.unique().tolist():
            rows, task = tasks == t, self.tasks[t]
            out[rows, task.offset : task.offset + task.num_classes] = self.task_logits(x[rows], t).to(out.dtype)
        return out
