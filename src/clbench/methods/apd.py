"""APD (Yoon, Kim, Yang & Hwang, ICLR 2020): additive parameter decomposition, exact to the official code
(jaehong31/APD cifar100_apd.py).

Every decomposed Linear keeps, for each task t, theta_t = sigma * sigmoid(M_t) + tau_t (+ tau~_g): sigma the weights
all tasks share (trainable in every task), M_t a mask over output units, tau_t a sparse task-adaptive tensor, tau~_g
the part of tau_t that its task's cluster shares after a consolidation, and b_t a per-task bias. Training task t
minimises (``build_model``)

    CE + l_wd (l2(tau_t) + l2(M_t) + [t = 0] l2(sigma)) + l_1 |tau_t|_1 + l_m |M_t|_1
       + sum_{j<t} (l_2 l2(theta_j - theta_j^ref) + l_1 |tau_j|_1),          l2(x) = sum(x^2) / 2,

theta_j^ref being theta_j as task t starts (the retroactive drift penalty: earlier tau_j, and, as in the code,
earlier masks, follow the changes of sigma). At test theta_t = sigma * H(sigmoid(M_t), l_m) + H(tau_t, l_1) + H(tau~,
l_1) with H(x, c) = x 1[|x| > c] (``build_model_test``). Every ``every`` tasks the tau's of all tasks are clustered
per layer (k-means, k = k_centroids * tasks / every) and each cluster's near-equal entries (max - min <= e_gap)
become its tau~_g = (max + min) / 2, frozen, so each theta_j moves by at most e_gap / 2.

Consolidation's k-means (``kmeans=code``) is the code's: centroids from a random shuffle of the tasks' tensors (the
previous round's centroids first, warm-started), exactly 100 Lloyd iterations, and an emptied cluster stays empty (its
mean is NaN, never nearest); ``kmeans=sklearn`` is scikit-learn's k-means++ with one init. As in the code, every
gradient is multiplied by ``grad_scale`` = 10 before the optimizer (with Adam it changes only the coordinates whose
|g| is near epsilon).

ViT adaptation (design choices): the Linears of every block (``layers``: qkv, proj, fc1, fc2) are decomposed, with
sigma the backbone's weight. The rest of the backbone (patch and position embeddings, class token, every LayerNorm),
which the code's CNN does not have, is frozen (``others=frozen``, for a pretrained ViT) or trained as shared
parameters by every task (``others=shared``, for a ViT trained from scratch, as the code trains all its layers), with
no APD term: old tasks are not held against their changes. ``init=keep`` (clbench's default) starts every task at the
current shared function: M_t = ``mask_init`` (sigmoid = 0.9975), tau_t = 0, b_t = the pretrained bias; ``init=code``
is the code's: M_t, b_t ~ variance scaling, tau_t = sigma (theta = 1.5 sigma, which breaks a pretrained ViT). Dropped
from the code: the best-of-the-last-5-epochs model selection on validation (clbench trains every task to its last
epoch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.cluster import KMeans
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Task
from clbench.methods.base import Logs, Method, Phase
from clbench.methods.masking import DEFAULT_TARGETS


@dataclass
class APDConfig:
    l1: float = 4.0e-4  # l_1 (l1_hyp): sparsity of tau and the test-time threshold [code: Split CIFAR-100]
    drift: float = 100.0  # l_2 (approx_hyp): retroactive drift penalty [code]
    wd: float = 1.0e-4  # l_wd: l2 of tau_t, M_t and (task 0) sigma [code]
    mask_l1: float = 0.0  # l_m (mask_hyp): L1 of M_t and its test-time threshold [code: 0]
    e_gap: float = 1.0e-2  # consolidation: entries within e_gap across a cluster are shared [code]
    every: int = 5  # consolidate after every ``every`` tasks (clustering_iter) [code]
    k_centroids: int = 2  # clusters a round: k_centroids * tasks / every [code]
    init: str = "keep"  # keep: each task starts at the shared function [clbench] | code: the official init
    mask_init: float = 6.0  # init=keep: M_t's value (sigmoid 0.9975) [clbench]
    old_masks: str = "train"  # train: earlier M_j follow the drift penalty, as the code | freeze: they stay as learned
    layers: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    kmeans: str = "code"  # code: shuffle init, warm start, 100 iterations, empty clusters kept [code] | sklearn
    grad_scale: float = 10.0  # every gradient's factor before the optimizer [code: x10] | 1: none
    others: str = "frozen"  # the backbone outside ``layers``: frozen [clbench] | shared: trained by every task

    def __post_init__(self) -> None:
        for key in ("l1", "drift", "wd", "mask_l1", "e_gap"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, f"method.{key}", value, "a float >= 0")
        require(math.isfinite(self.mask_init), "method.mask_init", self.mask_init, "a finite float")
        require(
            math.isfinite(self.grad_scale) and self.grad_scale > 0,
            "method.grad_scale",
            self.grad_scale,
            "a finite float > 0",
        )
        require(self.every >= 1, "method.every", self.every, "an integer >= 1")
        require(self.k_centroids >= 1, "method.k_centroids", self.k_centroids, "an integer >= 1")
        require_choice("method.init", self.init, ("keep", "code"))
        require_choice("method.old_masks", self.old_masks, ("train", "freeze"))
        require_choice("method.kmeans", self.kmeans, ("code", "sklearn"))
        require_choice("method.others", self.others, ("frozen", "shared"))
        subset = bool(self.layers) and set(self.layers) <= set(DEFAULT_TARGETS)
        require(subset, "method.layers", self.layers, f"a non-empty subset of {list(DEFAULT_TARGETS)}")


def l2(x: torch.Tensor) -> torch.Tensor:
    """tf.nn.l2_loss: sum(x^2) / 2."""
    return x.square().sum() / 2


def hard_threshold(x: torch.Tensor, c: float) -> torch.Tensor:
    """H(x, c) = x 1[|x| > c] (``l1_pruning``)."""
    return x * (x.abs() > c)


def consolidate(
    full: list[torch.Tensor], labels: list[int], e_gap: float
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """``aw_consolidation`` for one layer: ``full[j]`` = tau_j + its current tau~. A cluster of >= 2 tasks shares
    tau~ = (max + min) / 2 where max - min <= e_gap (0 elsewhere) and each member keeps full_j where the gap is larger;
    a task alone in its cluster keeps its full tensor. Returns ({cluster: tau~}, [new tau_j])."""
    shared: dict[int, torch.Tensor] = {}
    taus: list[torch.Tensor] = [f.clone() for f in full]
    for cluster in sorted(set(labels)):
        members = [j for j, label in enumerate(labels) if label == cluster]
        if len(members) < 2:
            continue
        stack = torch.stack([full[j] for j in members])
        high, low = stack.amax(0), stack.amin(0)
        apart = (high - low) > e_gap
        shared[cluster] = torch.where(apart, 0.0, (high + low) / 2)
        for j in members:
            taus[j] = full[j] * apart
    return shared, taus


def code_kmeans(
    points: torch.Tensor, k: int, previous: torch.Tensor | None = None, iterations: int = 100
) -> tuple[list[int], torch.Tensor]:
    """``k_means_clustering``'s k-means of ``points`` (n, D): the first k rows of a random shuffle as centroids, the
    previous round's ``previous`` (k', D) in the first k' places; ``iterations`` Lloyd steps, each assigning every point
    to its nearest centroid (the first on a tie) then moving each centroid to its members' mean. A cluster left empty
    gets a NaN mean and is never nearest again. Returns (the last step's assignment, the final centroids)."""
    centroids = points[torch.randperm(len(points))[:k].to(points.device)].clone()
    if previous is not None:
        centroids[: len(previous)] = previous
    labels = points.new_zeros(len(points), dtype=torch.long)
    for _ in range(iterations):
        dist = torch.stack([(points - c).square().sum(1) for c in centroids])  # (k, n), no cdist rounding
        labels = dist.nan_to_num(nan=math.inf).argmin(0)
        sums = points.new_zeros(k, points.shape[1]).index_add_(0, labels, points)
        centroids = sums / torch.bincount(labels, minlength=k).to(points.dtype)[:, None]  # empty: 0 / 0 = NaN
    return labels.tolist(), centroids


class APDLinear(nn.Module):
    """A Linear decomposed per task: theta_t = sigma * sigmoid(M_t) + tau_t (+ tau~ of t's cluster), bias b_t.
    ``task`` picks the task; in eval mode tau and tau~ are thresholded at ``threshold`` and sigmoid(M) at
    ``mask_threshold``."""

    def __init__(self, linear: nn.Linear, threshold: float, mask_threshold: float) -> None:
        super().__init__()
        self.sigma = linear.weight
        bias = linear.bias.detach().clone() if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
        self.register_buffer("pretrained_bias", bias)
        self.masks, self.taus, self.biases = nn.ParameterList(), nn.ParameterList(), nn.ParameterList()
        # tau~ a cluster, and a last row of zeros: the tau~ of a task in no cluster, so that reading a task's tau~
        # never asks the host which case it is
        self.register_buffer("tilde", linear.weight.new_zeros(1, *linear.weight.shape))
        self.register_buffer("cluster", torch.zeros(0, dtype=torch.long))  # each task's row of tilde
        self.register_buffer("centroids", linear.weight.new_zeros(0, *linear.weight.shape))  # kmeans=code's last
        self.threshold, self.mask_threshold = threshold, mask_threshold
        self.task: int | None = None

    def add_task(self, init: str, mask_init: float) -> None:
        sigma = self.sigma.detach()
        out = sigma.shape[0]
        if init == "keep":
            mask = sigma.new_full((out,), mask_init)
            tau = torch.zeros_like(sigma)
            bias = self.pretrained_bias.clone()
        else:  # tf.variance_scaling_initializer(): truncated normal, std sqrt(1 / fan_in), fan_in = shape[0] for 1-D
            std = math.sqrt(1 / out) / 0.87962566103423978
            mask = nn.init.trunc_normal_(sigma.new_empty(out), std=std, a=-2 * std, b=2 * std)
            bias = nn.init.trunc_normal_(sigma.new_empty(out), std=std, a=-2 * std, b=2 * std)
            tau = sigma.clone()
        self.masks.append(nn.Parameter(mask))
        self.taus.append(nn.Parameter(tau))
        self.biases.append(nn.Parameter(bias))
        self.cluster = torch.cat([self.cluster, self.cluster.new_full((1,), len(self.tilde) - 1)])

    def shared(self, task: int) -> torch.Tensor:
        """tau~ of ``task``'s cluster (zeros if it has none)."""
        return self.tilde.index_select(0, self.cluster[task : task + 1])[0]

    def theta(self, task: int, test: bool = False) -> torch.Tensor:
        gate, tau, shared = torch.sigmoid(self.masks[task]), self.taus[task], self.shared(task)
        if test:
            gate = hard_threshold(gate, self.mask_threshold)
            tau = hard_threshold(tau, self.threshold)
            shared = hard_threshold(shared, self.threshold)
        return self.sigma * gate[:, None] + tau + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.task is None:
            raise RuntimeError("APD's layers need a task id")
        return F.linear(x, self.theta(self.task, test=not self.training), self.biases[self.task])


class APD(Method):
    Config = APDConfig
    task_conditioned = True
    soft_targets = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.backbone.requires_grad_(False)
        self.layers: dict[str, APDLinear] = {}
        for target in self.config.layers:
            found = [
                name
                for name, module in self.backbone.named_modules()
                if isinstance(module, nn.Linear) and name.startswith("blocks.") and name.endswith(target)
            ]
            require(bool(found), "method.layers", target, "names of Linears in the backbone's blocks")
            for name in found:
                layer = APDLinear(self.backbone.get_submodule(name), self.config.l1, self.config.mask_l1)
                parent, _, child = name.rpartition(".")
                setattr(self.backbone.get_submodule(parent), child, layer)
                self.layers[name] = layer
        decomposed = {id(p) for layer in self.layers.values() for p in layer.parameters()}
        # others=shared: the rest of the backbone, trained by every task as the code trains every layer
        self.others = [p for p in self.backbone.parameters() if id(p) not in decomposed]
        self.register_buffer("capacity", torch.zeros(0))  # after each task (code: ``run.py`` "capacity")
        self._trained: list[nn.Parameter] = []

    # ----------------------------------------------------------------------------- forward
    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is None:
            raise ValueError("APD needs a task id to pick its parameters")
        for layer in self.layers.values():
            layer.task = task_id
        try:
            return super().features(x, task_id)
        finally:
            for layer in self.layers.values():
                layer.task = None

    # ----------------------------------------------------------------------------- training
    def grow(self) -> None:
        """A new task's mask, tau and bias in every decomposed layer."""
        for layer in self.layers.values():
            layer.add_task(self.config.init, self.config.mask_init)

    def before_task(self, task: Task) -> None:
        super().before_task(task)
        self.grow()
        with torch.no_grad():  # theta_j^ref: every earlier task's parameters as this task starts
            for i, layer in enumerate(self.layers.values()):
                refs = [layer.theta(j) for j in range(task.id)]
                self.register_buffer(f"ref_{i}", torch.stack(refs) if refs else layer.tilde.new_zeros(0))

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """sigma, the task's M, tau, bias and head, every earlier tau (and M, ``old_masks=train``): the drift
        penalty's handles; with ``others=shared`` the rest of the backbone. APD's own l2 terms replace the optimizer's
        weight decay."""
        self.requires_grad_(False)
        t = task.id
        params = [*self.heads[t].parameters()]
        for layer in self.layers.values():
            params += [layer.sigma, layer.masks[t], layer.biases[t], *layer.taus[: t + 1]]
            if self.config.old_masks == "train":
                params += list(layer.masks[:t])
        if self.config.others == "shared":
            params += self.others
        for p in params:
            p.requires_grad_(True)
        self._trained = params
        return [{"params": params, "weight_decay": 0.0}]

    def regulariser(self, task_id: int) -> torch.Tensor:
        """Every term of the loss but the cross-entropy, summed over the decomposed layers (``build_model``)."""
        cfg, t = self.config, task_id
        total = self.heads[t].weight.new_zeros(())
        for i, layer in enumerate(self.layers.values()):
            tau, mask = layer.taus[t], layer.masks[t]
            wd = l2(tau) + l2(mask) + (l2(layer.sigma) if t == 0 else 0)
            total = total + cfg.wd * wd + cfg.l1 * tau.abs().sum() + cfg.mask_l1 * mask.abs().sum()
            if t:
                refs = getattr(self, f"ref_{i}")
                drift = sum(l2(layer.theta(j) - refs[j]) for j in range(t))
                total = total + cfg.drift * drift + cfg.l1 * sum(layer.taus[j].abs().sum() for j in range(t))
        return total

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        regulariser = self.regulariser(task.id)
        return self.task_loss(self.task_logits(x, task.id), y, task) + regulariser, {"apd_reg": regulariser.detach()}

    @torch.no_grad()
    def after_backward(self, task: Task) -> None:
        """The code's ``grad * 10.`` on every gradient before Adam (``optimization``)."""
        if self.config.grad_scale != 1:
            torch._foreach_mul_([p.grad for p in self._trained if p.grad is not None], self.config.grad_scale)

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        tasks = task.id + 1
        if tasks % self.config.every == 0:
            for layer in self.layers.values():
                self.consolidate_layer(layer, tasks)
        self.capacity = torch.cat([self.capacity, self.capacity.new_tensor([self.current_capacity()])])

    def consolidate_layer(self, layer: APDLinear, tasks: int) -> None:
        """Hierarchical knowledge consolidation of one layer (``k_means_clustering`` + ``aw_consolidation``): k-means
        (100 Lloyd iterations) on every task's full tau, k = k_centroids * tasks / every."""
        full = [layer.taus[j] + layer.shared(j) for j in range(tasks)]
        k = min(tasks, self.config.k_centroids * tasks // self.config.every)
        points = torch.stack(full).flatten(1).float()
        if self.config.kmeans == "code":
            previous = layer.centroids.flatten(1).float() if len(layer.centroids) else None
            labels, centroids = code_kmeans(points, k, previous)
            layer.centroids = centroids.view(k, *full[0].shape).to(full[0].dtype)
        else:
            seed = int(torch.randint(2**31 - 1, ()))
            fit = KMeans(n_clusters=k, n_init=1, max_iter=100, random_state=seed)
            labels = fit.fit_predict(points.cpu().numpy()).tolist()
        shared, taus = consolidate(full, labels, self.config.e_gap)
        zeros = torch.zeros_like(full[0])
        layer.tilde = torch.stack([*(shared.get(g, zeros) for g in range(k)), zeros])
        layer.cluster = layer.cluster.new_tensor([g if g in shared else k for g in labels])
        for j, tau in enumerate(taus):
            layer.taus[j].copy_(tau)

    # ----------------------------------------------------------------------------- bookkeeping
    def current_capacity(self) -> float:
        """The code's "capacity": non-zero parameters a deployed model keeps (sigma, every mask, thresholded tau and
        tau~, every bias and head, and with ``others=shared`` the rest of the backbone, trainable variables the code
        would count) over its ``full_base``: one network's decomposed weights plus the weights of every head but the
        newest (the code's 500 n idx after task idx). The code counts only the newest task's bias and head; clbench
        counts all it keeps."""
        kept = base = 0
        for layer in self.layers.values():
            test = [hard_threshold(tau, layer.threshold) for tau in layer.taus]
            kept += int(layer.sigma.count_nonzero()) + sum(int(m.count_nonzero()) for m in layer.masks)
            kept += sum(int(t.count_nonzero()) for t in test) + sum(b.numel() for b in layer.biases)
            kept += int(hard_threshold(layer.tilde, layer.threshold).count_nonzero())
            base += layer.sigma.numel()
        kept += sum(p.numel() for h in self.heads for p in h.parameters())
        if self.config.others == "shared":
            kept += sum(int(p.count_nonzero()) for p in self.others)
        return kept / (base + sum(h.weight.numel() for h in self.heads[:-1]))

    def storage(self) -> dict[str, Any]:
        """Per task: its mask and bias (32 bits an output unit) and the values of its thresholded tau (32 bits a
        non-zero; a sparse format adds their indices); shared: sigma, the clusters' tau~ and, ``others=shared``, the
        rest of the backbone."""
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            entry["masks"] = 32 * sum(layer.masks[t].numel() for layer in self.layers.values())
            entry["biases"] = 32 * sum(layer.biases[t].numel() for layer in self.layers.values())
            entry["tau"] = 32 * sum(
                int(hard_threshold(layer.taus[t], layer.threshold).count_nonzero()) for layer in self.layers.values()
            )
        layers = self.layers.values()
        out["shared_bits"] = {
            "sigma": 32 * sum(layer.sigma.numel() for layer in layers),
            "tau_shared": 32 * sum(int(hard_threshold(la.tilde, la.threshold).count_nonzero()) for la in layers),
        }
        if self.config.others == "shared":  # trained by every task: part of what the method keeps
            out["shared_bits"]["others"] = 32 * sum(p.numel() for p in self.others)
        return out

    def extra_results(self) -> dict[str, Any]:
        """The capacity after each task, and what trained the backbone outside the decomposed Linears."""
        others = sum(p.numel() for p in self.others)
        return {"apd": {"capacity": self.capacity.tolist(), "others": self.config.others, "others_params": others}}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        for _ in {k.split(".")[1] for k in tensors if k.startswith("head.")}:
            self.grow()
        for name, layer in self.layers.items():
            layer.tilde = torch.empty_like(tensors[f"backbone.{name}.tilde"], device=layer.sigma.device)
            layer.centroids = torch.empty_like(tensors[f"backbone.{name}.centroids"], device=layer.sigma.device)
        super().load_artifacts(tensors)
