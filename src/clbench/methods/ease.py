"""EASE, Expandable Subspace Ensemble (Zhou, Sun, Ye, Zhan, "Expandable Subspace Ensemble for Pre-Trained
Model-Based Class-Incremental Learning", CVPR 2024): a new AdaptFormer adapter set per task on the frozen pretrained
ViT, each spanning a feature subspace; a class's prototype in every subspace, synthesised for the old classes in the
subspaces added after them; the subspaces' cosines ensembled with the class's own subspace weighted most. Official
code sun-hailong/CVPR24-Ease@6d67508 (models/ease.py, utils/inc_net.py ``EaseNet`` L116-185, backbone/vit_ease.py,
backbone/linears.py ``forward_reweight`` L45-93, exps/ease_*.json, logs/ease/*).

Task t (``incremental_train`` L228-251, ``_init_train`` L305-360): a fresh adapter set A_t (W_up = 0; vit_ease.py
``get_new_adapter`` L285-298), the earlier sets frozen; phi_t(x) = the ViT's features through A_t. A_t and a temporary
sigma-scaled cosine proxy head over the task's classes (``proxy_fc``, inc_net.py L145-148) train with cross-entropy on
the task's local labels; SGD momentum 0.9 (or Adam) with weight decay on both, cosine annealing to 0 over the task.

Then one pass over the task's training images through the test transform (``replace_fc`` L60-99): the prototype of
each new class c in each subspace k, P[c, k] = the mean of phi_k over c's images, for k = the pretrained ViT
(``ptm_block``, the code's ``use_init_ptm``) and A_0 .. A_t. An old class a (task i < t) has no images: in each later
subspace j its prototype is synthesised (semantic-guided prototype complement, ``solve_sim_reset`` L176-226), with R
the classes learned from task j on: S[a, r] = softmax_r cos(P[a, i], P[r, i]) (no temperature), P[a, j] =
sum_r S[a, r] P[r, j]; recomputed every task as R grows (``recompute_complement: false``: ``solve_similarity``
L151-174, only the newest subspace, from the new task's classes). The code's double loops, vectorised here.

Logits (``forward_reweight``): for a class c of task i after task t,
    z_c(x) = beta cos(phi_PTM(x), P[c, PTM]) + cos(phi_i(x), P[c, i])
             + sum_{j <= t, j != i} (alpha / t) cos(phi_j(x), P[c, j])
(the first term with ``ptm_block``; EaseNet's sigma stays 1); ``reweight: false`` (``use_reweight``) is the plain
cosine of the concatenated features and prototypes. CIL: argmax over the seen classes; TIL: over the task's classes.
t + 1 ViT forwards a test image (t + 2 with the PTM block).

``aper_mode`` (the code's ``moni_adam`` with ``adapter_num`` 1, every OmniBenchmark config; L39-42, L72-74,
L306-308): only A_0 trains, no complement, the plain cosine over [phi_PTM; phi_0]: APER with an adapter, not EASE. The
code still adds an untrained set every task and runs the test images through all of them, whose prototype columns stay
0: the same predictions (a positive per-image scale of the logits) at 2 forwards a test image here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require
from clbench.data import Benchmark, Task
from clbench.methods.adapter_set_learner import AdapterSetLearner
from clbench.methods.base import Logs, Phase
from clbench.methods.first_session import vit_features
from clbench.methods.parts.adaptformer import AdapterConfig
from clbench.methods.parts.cosine import CosineHead, cosine_logits


@dataclass
class EASEConfig(AdapterConfig):
    """The adapter's keys (``ffn_num``, s 0.1, dropout 0.1) and the ensemble's (exps/ease_*.json)."""

    alpha: float = 0.1  # weight of the other subspaces' cosines, divided by t
    ptm_block: bool = False  # the pretrained ViT's features as a subspace, weighted beta (use_init_ptm)
    beta: float = 0.0  # weight of the pretrained ViT's subspace
    reweight: bool = True  # the reweighted ensemble (use_reweight); false: the plain cosine of the concatenation
    recompute_complement: bool = True  # every old subspace's complement recomputed each task (recalc_sim)
    aper_mode: bool = False  # the code's moni_adam (adapter_num 1): A_0 only, plain cosine over [phi_PTM; phi_0]

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.alpha >= 0, "method.alpha", self.alpha, ">= 0")
        require(self.beta >= 0, "method.beta", self.beta, ">= 0")


class EASE(AdapterSetLearner):
    """``heads[t].weight`` holds task ``t``'s prototypes, (classes, subspaces, d) flattened over every subspace the
    run can have (a subspace not there yet is zeros); the adapter sets live in the backbone's blocks."""

    Config = EASEConfig

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: EASEConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.ptm = config.ptm_block or config.aper_mode  # moni_adam sets use_init_ptm (L39-42)
        self.trained_sets = 1 if config.aper_mode else len(self.tasks)  # adapter sets the run trains
        self.width = int(self.ptm) + self.trained_sets  # subspaces a prototype can have
        self.proxy: CosineHead | None = None  # the task's proxy_fc while it trains
        self.sums: torch.Tensor | None = None  # (subspaces, classes, d) while the task is observed
        self.counts: torch.Tensor | None = None

    @classmethod
    def scores_unseen_classes(cls) -> bool:
        """No: an untrained task has no prototypes in any subspace to score its classes with."""
        return False

    @staticmethod
    def unused_keys(config: EASEConfig) -> dict[str, str]:
        if config.aper_mode:
            why = "method.aper_mode=true (moni_adam: the plain cosine over [phi_PTM; phi_0], no complement)"
            keys = ("alpha", "beta", "ptm_block", "reweight", "recompute_complement")
            return {f"method.{key}": why for key in keys}
        out = {} if config.ptm_block else {"method.beta": "method.ptm_block=false"}
        if not config.reweight:
            out |= dict.fromkeys(("method.alpha", "method.beta"), "method.reweight=false (the plain cosine)")
        return out

    # ----------------------------------------------------------------------------- subspaces
    def subspaces(self) -> list[int | None]:
        """The subspaces in feature order: the pretrained ViT (None) with the PTM block, then each adapter set."""
        return [None] * self.ptm + list(range(len(self.sets)))

    def block(self, task_id: int) -> int:
        """The position of task ``task_id``'s adapter set among the subspaces."""
        return int(self.ptm) + task_id

    def trains(self, task: Task) -> bool:
        return task.id < self.trained_sets

    def subspace_features(self, x: torch.Tensor, k: int | None) -> torch.Tensor:
        """phi_k(x): the ViT's features through adapter set ``k`` (None: the pretrained ViT); one ViT forward."""
        with self.sets.use(k):
            return vit_features(self.backbone, x)

    def prototypes(self, task_id: int) -> torch.Tensor:
        """Task ``task_id``'s prototypes as (classes, subspaces, d), a view of its head."""
        head = self.heads[task_id]
        return head.weight.view(head.out_features, self.width, self.backbone.num_features)

    # ----------------------------------------------------------------------------- lifecycle
    def new_head(self, num_classes: int) -> nn.Linear:
        """The task's prototypes in every subspace the run can have (filled by the observe pass and the complement)."""
        width = self.width * self.backbone.num_features
        head = nn.Linear(width, num_classes, bias=False, device=self.backbone.pos_embed.device)
        nn.init.zeros_(head.weight)
        return head.requires_grad_(False)

    def before_task(self, task: Task) -> None:
        """The task's head; where it trains, a fresh adapter set and proxy head (update_fc, get_new_adapter)."""
        super().before_task(task)
        if self.trains(task):
            self.sets.add()
            d = self.backbone.num_features
            self.proxy = CosineHead(d, task.num_classes, device=self.backbone.pos_embed.device)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        prototypes = Phase("prototypes", 1, observe=True)  # train_loader_for_protonet: mode="test"
        return [Phase("train", epochs), prototypes] if self.trains(task) else [prototypes]

    def before_phase(self, task: Task, phase: Phase) -> None:
        if not phase.observe:
            self.sets.select(task.id)  # forward_train: the ViT through cur_adapter
            return
        if self.trains(task):
            self.freeze(task)
        shape = (len(self.subspaces()), task.num_classes, self.backbone.num_features)
        device = self.backbone.pos_embed.device
        self.sums = torch.zeros(shape, dtype=torch.float64, device=device)
        self.counts = torch.zeros(task.num_classes, dtype=torch.float64, device=device)

    def freeze(self, task: Task) -> None:
        """The task's adapter set and proxy head, frozen before its prototypes are taken (the code: after_task)."""
        self.sets.freeze(task.id)
        self.sets.select(None)
        if self.proxy is not None:
            self.proxy.requires_grad_(False)

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        assert self.proxy is not None  # set by before_task
        return [{"params": [*self.sets.parameters(task.id), *self.proxy.parameters()]}]

    def no_weight_decay_ids(self) -> set[int]:
        """None: the code's optimizer decays every trained parameter (the adapter's biases, the proxy's sigma)."""
        return set()

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """Cross-entropy of the proxy head's sigma · cos(phi_t(x), w_c) over the task's classes (local labels)."""
        assert self.proxy is not None
        return self.task_loss(self.proxy(vit_features(self.backbone, x)), y, task), {}

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """Each subspace's features of the batch, summed per class."""
        assert self.sums is not None and self.counts is not None  # set by before_phase
        local = y - task.offset
        for b, k in enumerate(self.subspaces()):
            self.sums[b].index_add_(0, local, self.subspace_features(x, k).double())
        self.counts.index_add_(0, local, torch.ones_like(local, dtype=torch.float64))

    def observations(self) -> list[torch.Tensor]:
        return [t for t in (self.sums, self.counts) if t is not None]

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """The new classes' prototypes in every subspace (a class without images keeps zeros), then the complement
        of every old class; the proxy head is dropped."""
        if self.sums is not None and self.counts is not None:
            means = self.sums / self.counts.clamp(min=1)[None, :, None]
            self.prototypes(task.id)[:, : len(means)] = means.transpose(0, 1).to(self.heads[task.id].weight.dtype)
            self.sums = self.counts = None
        self.complement(task.id)
        self.proxy = None

    @torch.no_grad()
    def complement(self, t: int) -> None:
        """solve_sim_reset (solve_similarity without ``recompute_complement``) after task ``t``: each old task i's
        prototypes in each later subspace j from the classes R learned from task j on (real prototypes in both
        subspaces): P[T_i, j] = softmax(cos(P[T_i, i], P[R, i])) P[R, j]. Reads only real prototypes, so the order of
        the pairs does not matter."""
        protos = torch.cat([self.prototypes(k) for k in range(t + 1)])
        last = min(t, self.trained_sets - 1)  # the newest subspace with its own classes
        for i in range(t):
            old = slice(self.tasks[i].offset, self.tasks[i].offset + self.tasks[i].num_classes)
            later = range(i + 1, last + 1) if self.config.recompute_complement else range(max(i + 1, t), last + 1)
            for j in later:
                learned = slice(self.tasks[j].offset, len(protos))
                similarity = F.softmax(cosine_logits(protos[old, self.block(i)], protos[learned, self.block(i)]), 1)
                protos[old, self.block(j)] = similarity @ protos[learned, self.block(j)].float()
        for k in range(t):
            self.prototypes(k).copy_(protos[self.tasks[k].offset : self.tasks[k].offset + self.tasks[k].num_classes])

    # ----------------------------------------------------------------------------- inference
    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """[phi_PTM(x); phi_0(x); ...; phi_t(x)]: one ViT forward per subspace (forward_test)."""
        return torch.cat([self.subspace_features(x, k) for k in self.subspaces()], dim=1)

    def head_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        return self.ensemble_logits(feats, range(task_id, task_id + 1))

    def seen_logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.ensemble_logits(feats, range(self.num_seen))

    def ensemble_logits(self, feats: torch.Tensor, tasks: range) -> torch.Tensor:
        """The classes of ``tasks``: forward_reweight's sum over subspaces of weight · cos(phi_k(x), P[c, k]), or the
        plain cosine of the concatenations (APER mode, ``reweight: false``); fp32 whatever the autocast."""
        subspaces, d = len(self.subspaces()), self.backbone.num_features
        protos = torch.cat([self.prototypes(i)[:, :subspaces] for i in tasks])
        if self.config.aper_mode or not self.config.reweight:
            return cosine_logits(feats, protos.flatten(1))
        with torch.autocast(feats.device.type, enabled=False):
            blocks = F.normalize(feats.float().view(len(feats), subspaces, d), dim=2)
            cosines = torch.einsum("bkd,ckd->bkc", blocks, F.normalize(protos.float(), dim=2))
            return (cosines * self.subspace_weights(tasks, subspaces).to(cosines.device)).sum(1)

    def subspace_weights(self, tasks: range, subspaces: int) -> torch.Tensor:
        """(subspaces, classes): 1 in a class's own subspace, beta in the PTM's, alpha / t elsewhere, t the index of
        the newest task (no other subspace at t = 0)."""
        t = self.num_seen - 1
        sizes = [self.tasks[i].num_classes for i in tasks]
        weights = torch.full((subspaces, sum(sizes)), self.config.alpha / t if t else 0.0)
        if self.ptm:
            weights[0] = self.config.beta
        start = 0
        for i, size in zip(tasks, sizes, strict=True):
            weights[self.block(i), start : start + size] = 1.0
            start += size
        return weights

    # ----------------------------------------------------------------------------- bookkeeping
    def forwards_per_test_image(self) -> dict[str, int]:
        """One ViT forward per subspace for either scenario (TIL's logits ensemble every subspace too)."""
        n = len(self.subspaces())
        return {"til": n, "cil": n}

    def storage(self) -> dict[str, Any]:
        """Per task: its adapter set and its classes' prototypes in every subspace so far (32-bit; they grow with
        every task). Trainable: what the newest trained task trained (its adapter set and proxy head)."""
        subspaces, d = len(self.subspaces()), self.backbone.num_features
        per_task = []
        for task in self.tasks[: self.num_seen]:
            adapter = {"adapter": 32 * self.sets.numel(task.id)} if task.id < len(self.sets) else {}
            per_task.append(adapter | {"prototypes": 32 * task.num_classes * subspaces * d})
        last = min(self.num_seen, self.trained_sets) - 1  # the newest task that trained
        trainable = self.sets.numel(last) + self.tasks[last].num_classes * d + 1 if last >= 0 else 0  # + proxy, sigma
        return {"bits_per_task": per_task, "trainable_params": trainable}

    def extra_results(self) -> dict[str, Any]:
        mode = "aper (moni_adam: only adapter 0, plain cosine)" if self.config.aper_mode else "ease"
        return {"ease": {"mode": mode, "subspaces": len(self.subspaces()), "ptm_block": self.ptm}}
