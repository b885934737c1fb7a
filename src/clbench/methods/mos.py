"""MOS, Model Surgery (Sun, Zhou, Zhao, Gan, Zhan, Ye, "MOS: Model Surgery for Pre-Trained Model-Based Class-Incremental
Learning", AAAI 2025): an AdaptFormer adapter set per task on the frozen pretrained ViT, each merged toward the mean of
the earlier ones; a linear head over every class aligned on samples of class Gaussians; at test, the task a
prototype classifier picks, refined by the head, and the two ensembled. Official code sun-hailong/AAAI25-MOS@8d5e07c
(models/mos.py, backbone/vit_mos.py, utils/inc_net.py L105-147, exps/mos_*.json, logs/mos/*).

Task t (``incremental_train`` L76-103, ``_train`` L105-116):

- Train (``_init_train`` L152-196): phi_t(x) = the ViT through adapter set A_t (``continue``: a copy of A_{t-1} as it
  ended, the code's ``cur_adapter`` that is never re-initialised; ``fresh``: W_up = 0). A_t and the task's head train
  with cross-entropy over the task's classes (the code's full head with old logits at -inf) plus
  ``reg`` L_proto (``orth_loss`` L335-355): with the means mu_1..mu_K of every earlier class and the batch's features
  f_1..f_B stacked as rows of M, L_proto = CE(M M^T / 0.8, [0 .. K+B-1]). One SGD (momentum 0.9): A_t at the lr, the
  head at ``head_lr_scale`` x the lr, weight decay on both (L118-140). After each step A_t is pulled toward the mean of
  the finished sets, A_t <- (1 - m) A_t + m S_{t-1} / t (``adapter_merge``, vit_mos.py L303-308; m =
  ``adapter_momentum``; S the prefix sums of :class:`~clbench.methods.parts.adapter_sets.SetSums`).
- Statistics (one pass, test transform): A_t's prefix sum (``adapter_update``), then each new class's mean and
  covariance of phi_t (``_compute_mean`` L198-245; the variance only for ImageNet-A) and its prototype p_c, the mean of
  phi_0 (the ViT through A_0: ``forward_orig``, inc_net.py L135-142; ``proto_branch=ptm``: the bare ViT).
- Alignment (t >= 1, ``classifer_align`` L247-333): every head trains on 5 x batch samples a seen class of N(mu_c,
  Sigma_c) for 30 epochs (:mod:`~clbench.methods.parts.gaussian_alignment`, MOS's column: SGD lr 0.005, plain CE).

Prediction after task t (``_eval_cnn`` L357-415), per image: z_0 = cos(phi_0(x), p_c) over the seen classes; the task
i of its argmax; then up to 4 rounds: l = head(phi_i(x)), i' = the task of l's argmax, stop when i' = i (else i <- i');
the score is softmax(l) + softmax((t + 1) z_0) (``ensemble``). t + 1 ViT forwards an image (the code runs phi_0
twice). TIL: task j's head on phi_j(x), one forward.

``merge_mode``: ``ema_step`` (default) pulls A_t once after each step and nothing else; ``official`` is what the code
does: ``reweight_adapter`` (vit_mos.py L328-346) runs in place inside every forward, once before each block, so a
forward through A_i (i >= 1) pulls it L times toward S_{i-1} / i (L359-377): in training, in the statistics pass (on
``cur_adapter``, which then carries into the next task) and at test on the stored set itself, which drifts with every
evaluated batch. A prediction then depends on the batches evaluated before it (results.json's
``evaluation.batch_level`` names ``method.merge_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Split, Task
from clbench.distributed import share_bounds
from clbench.methods.adapter_set_learner import AdapterSetLearner
from clbench.methods.base import HEAD_INITS, Logs, Phase, init_head
from clbench.methods.first_session import vit_features
from clbench.methods.parts.adapter_sets import SetSums, pull
from clbench.methods.parts.adaptformer import AdapterConfig
from clbench.methods.parts.cosine import cosine_logits
from clbench.methods.parts.gaussian_alignment import AlignmentConfig, GaussianAligner

MERGE_MODES = ("ema_step", "official")


def mos_alignment() -> AlignmentConfig:
    """MOS's column of the alignment (mos.py L247-333, exps/mos_cifar.json): 30 epochs of 5 x 48 samples a class in
    batches of 5 x 48, every sample once, plain CE, SGD lr 0.005 with the config's weight decay, no head restore."""
    return AlignmentConfig(
        epochs=30, samples_per_class=240, batch_size=240, mean_shrink="none", logit_norm=None, lr=0.005,
        weight_decay=5e-4, restore=False,
    )  # fmt: skip


@dataclass
class MOSConfig(AdapterConfig):
    """The adapter's keys (``ffn_num`` 16, s 0.1, dropout 0.1) and MOS's (exps/mos_*.json)."""

    bottleneck: int = 16  # r (ffn_num)
    adapter_momentum: float = 0.1  # m of the merge map
    reg: float = 0.1  # weight of L_proto
    proto_temperature: float = 0.8  # L_proto's divisor of M M^T (orth_loss L347)
    head_lr_scale: float = 0.1  # the head's lr as a share of the adapter's (L120)
    head_init: str = "trunc_normal"  # timm 0.6.12's head: N(0, 0.02) truncated, bias 0 [inference]
    refine_rounds: int = 4  # head evaluations of the self-refinement at most (MAX_ITER)
    ensemble: bool = True  # softmax(refined logits) + softmax((t + 1) cos) (ensemble)
    merge_mode: str = "ema_step"  # ema_step: one pull after each step | official: in place in every forward
    adapter_init: str = "continue"  # continue: A_t starts as A_{t-1} ended (the code) | fresh: W_up = 0
    proto_branch: str = "adapter0"  # the prototype classifier's features: adapter0 (the code) | ptm (the bare ViT)
    alignment: AlignmentConfig = field(default_factory=mos_alignment)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.adapter_momentum < 1, "method.adapter_momentum", self.adapter_momentum, "in [0, 1)")
        require(self.reg >= 0, "method.reg", self.reg, ">= 0")
        require(self.proto_temperature > 0, "method.proto_temperature", self.proto_temperature, "> 0")
        require(self.head_lr_scale > 0, "method.head_lr_scale", self.head_lr_scale, "> 0")
        require(self.refine_rounds >= 1, "method.refine_rounds", self.refine_rounds, "an integer >= 1")
        require_choice("method.head_init", self.head_init, HEAD_INITS)
        require_choice("method.merge_mode", self.merge_mode, MERGE_MODES)
        require_choice("method.adapter_init", self.adapter_init, ("continue", "fresh"))
        require_choice("method.proto_branch", self.proto_branch, ("adapter0", "ptm"))


class Prototypes(nn.Module):
    """One task's class prototypes (rows), a buffer."""

    def __init__(self, num_classes: int, dim: int, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_classes, dim, device=device))


class MOS(AdapterSetLearner):
    """``heads[t]`` is the code's head rows of task t's classes; ``prototypes[t]`` its cosine classifier's; the adapter
    sets live in the backbone's blocks (set t is task t's; in ``official`` mode set t + 1 is ``cur_adapter`` from
    the statistics pass on)."""

    Config = MOSConfig

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: MOSConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.sums = SetSums()
        self.prototypes = nn.ModuleList()
        self.aligner = GaussianAligner(config.alignment, backbone.num_features)
        self.official = config.merge_mode == "official"
        self.stage = "train"
        self.proto_sums: torch.Tensor | None = None  # (classes, d) fp64 while the task is observed
        self.proto_counts: torch.Tensor | None = None
        self.targets: dict[int, list[torch.Tensor]] = {}  # official mode: each drifting set's merge target
        if self.official:
            for block in backbone.blocks:
                block.register_forward_pre_hook(self.merge_in_forward)

    @classmethod
    def graph_blocker(cls, config: MOSConfig) -> str | None:
        """``official`` gives the running set's weights new tensors in every forward (as the code does): a captured step
        would keep reading the old ones."""
        official = config.merge_mode == "official" and config.adapter_momentum
        return "method.merge_mode=official re-points the adapters' weights in every forward" if official else None

    @classmethod
    def batch_level(cls, config: MOSConfig) -> list[str]:
        """``official``: the stored sets drift with every evaluated batch, so a prediction depends on the batches
        evaluated before it."""
        return ["method.merge_mode"] if config.merge_mode == "official" else []

    @staticmethod
    def unused_keys(config: MOSConfig) -> dict[str, str]:
        out = {} if config.adapter_momentum else {"method.merge_mode": "method.adapter_momentum=0 (no merge)"}
        if not config.reg:
            out["method.proto_temperature"] = "method.reg=0 (no L_proto)"
        if not config.alignment.epochs:
            keys = [k for k in vars(config.alignment) if k != "epochs"]
            out |= {f"method.alignment.{k}": "method.alignment.epochs=0" for k in keys}
        return out

    # ----------------------------------------------------------------------------- the merge map
    def target(self, k: int) -> list[torch.Tensor] | None:
        """Set ``k``'s merge target, the mean of the finished sets before it (None for set 0: nothing to merge):
        S_{i-1} / i with i = k, or the current task's index for ``cur_adapter`` (set t + 1 while task t is observed)."""
        i = min(k, self.num_seen - 1)
        if i < 1 or not self.config.adapter_momentum:
            return None
        if i not in self.targets:
            self.targets[i] = self.sums.mean(i)
        return self.targets[i]

    def merge_in_forward(self, block: nn.Module, args: tuple[Any, ...]) -> None:
        """``official``: before each block, the running set (every block's adapter) one pull toward its target."""
        k = self.sets.running
        target = None if k is None else self.target(k)
        if target is not None:
            pull(self.sets.parameters(k), target, self.config.adapter_momentum, in_place=False)

    # ----------------------------------------------------------------------------- lifecycle
    def new_head(self, num_classes: int) -> nn.Linear:
        head = super().new_head(num_classes)
        init_head(head, self.config.head_init)
        return head

    def before_task(self, task: Task) -> None:
        """The task's head, prototypes and Gaussians; its adapter set: fresh at the first task, else a copy of the
        previous one (``continue``) or fresh; in ``official`` mode it is ``cur_adapter``, made by the previous task's
        statistics pass."""
        super().before_task(task)
        self.aligner.add_task(self.heads[task.id])
        d, device = self.backbone.num_features, self.backbone.pos_embed.device
        self.prototypes.append(Prototypes(task.num_classes, d, device))
        self.targets = {}
        fresh = self.config.adapter_init == "fresh"
        if len(self.sets) == task.id:
            self.sets.add(None if task.id == 0 or fresh else task.id - 1)
        elif fresh:
            self.sets.reset(task.id)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [Phase("train", epochs), Phase("statistics", 1, observe=True), *self.aligner.phases(task)]

    def before_phase(self, task: Task, phase: Phase) -> None:
        self.stage = phase.name
        if phase.name == "train":
            self.sets.select(task.id)
        elif phase.name == "statistics":
            self.finish_set(task)
        elif phase.name == "align":
            self.settle(task)

    def finish_set(self, task: Task) -> None:
        """``adapter_update``: set t frozen and its prefix sum taken; ``official``: ``cur_adapter`` goes on as set
        t + 1, a copy, which the statistics pass runs through (and drifts). Then zero sums for the statistics."""
        self.sets.freeze(task.id)
        self.sums.add(self.sets, task.id)
        self.targets = {}
        running = task.id
        if self.official:
            running = self.sets.add(task.id)
            self.sets.freeze(running)
        self.sets.select(running)
        self.aligner.start()
        device = self.backbone.pos_embed.device
        self.proto_sums = torch.zeros(task.num_classes, self.backbone.num_features, dtype=torch.float64, device=device)
        self.proto_counts = torch.zeros(task.num_classes, dtype=torch.float64, device=device)

    @torch.no_grad()
    def settle(self, task: Task) -> None:
        """The statistics pass's sums -> the new classes' Gaussians and prototypes (once, before the alignment or at
        the task's end; a resume's replay settles its zeros before the checkpoint's values replace them)."""
        self.aligner.settle()
        if self.proto_sums is not None and self.proto_counts is not None:
            means = self.proto_sums / self.proto_counts.clamp(min=1)[:, None]
            self.prototypes[task.id].weight.copy_(means)
            self.proto_sums = self.proto_counts = None

    def after_task(self, task: Task) -> None:
        """The new classes' Gaussians and prototypes (where no alignment settled them); ``official``: the last task's
        ``cur_adapter`` dropped."""
        self.settle(task)
        if self.official and task.id == len(self.tasks) - 1 and len(self.sets) > len(self.tasks):
            self.sets.pop()
        self.sets.select(None)
        self.stage = "train"

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """Train: set t at the lr, head t at ``head_lr_scale`` x the lr; align: every head."""
        self.requires_grad_(False)
        if phase.name == "align":
            return self.aligner.param_groups(self.heads)
        adapter = self.sets.parameters(task.id)
        for p in adapter:
            p.requires_grad_(True)
        head = self.heads[task.id].requires_grad_(True)
        return [{"params": adapter}, {"params": list(head.parameters()), "lr_factor": self.config.head_lr_scale}]

    def no_weight_decay_ids(self) -> set[int]:
        """None: the code's groups decay every parameter (L118-123)."""
        return set()

    # ----------------------------------------------------------------------------- training
    def proto_loss(self, feats: torch.Tensor, task: Task) -> torch.Tensor:
        """L_proto (``orth_loss``): CE(M M^T / temperature, identity labels) over M = [means of the earlier classes;
        the batch's features] in fp32."""
        means = [g.mean for g in self.aligner.tasks[: task.id]]
        rows = torch.cat([*means, feats.float()]) if means else feats.float()
        similarity = rows @ rows.T / self.config.proto_temperature
        return F.cross_entropy(similarity, torch.arange(len(rows), device=rows.device))

    def whole_batch(self, feats: torch.Tensor) -> tuple[torch.Tensor, float]:
        """A multi-process run's features of the whole batch (every rank's share, in order; the gradient flows back to
        each rank's own rows) and the factor that undoes the loop's weighting of this rank's loss: L_proto couples
        the rows of a batch, so each rank computes it on the whole batch and the averaged gradients are one
        process's (but for a last batch smaller than the world, whose empty rank's loss weighs 0). A single process:
        ``feats`` and 1."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return feats, 1.0
        size = self.batch_share[0] if self.batch_share else len(feats)
        world = dist.get_world_size()
        shares = [hi - lo for lo, hi in (share_bounds(size, world, r) for r in range(world))]
        padded = F.pad(feats, (0, 0, 0, -(-size // world) - len(feats)))
        parts = dist_nn.all_gather(padded)
        mine = shares[dist.get_rank()]
        return torch.cat([p[:n] for p, n in zip(parts, shares, strict=True)]), (size / (mine * world) if mine else 0.0)

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """Train: CE of head t over the task's classes + ``reg`` L_proto. Align: ``x`` are drawn features; CE over
        every seen class of the heads' logits."""
        if self.stage == "align":
            sizes = [t.num_classes for t in self.tasks[: task.id + 1]]
            with torch.autocast(x.device.type, enabled=False):
                return self.aligner.loss(self.head_scores(x.float()), y, sizes), {}
        feats = vit_features(self.backbone, x)
        whole, unweight = self.whole_batch(feats)
        with torch.autocast(x.device.type, enabled=False):
            proto = self.proto_loss(whole, task)
        loss = self.task_loss(self.heads[task.id](feats), y, task) + self.config.reg * unweight * proto
        return loss, {"proto": proto.detach()}

    def after_step(self, task: Task) -> None:
        """``adapter_merge``: set t one pull toward the mean of the finished sets (t >= 1)."""
        target = self.target(task.id) if self.stage == "train" else None
        if target is not None:
            pull(self.sets.parameters(task.id), target, self.config.adapter_momentum)

    def drawn_split(self, task: Task, phase: Phase, epoch: int) -> Split:
        return self.aligner.draw(self.tasks, task.id, epoch)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """The statistics' features (the running set: set t, or ``cur_adapter``) and the prototypes' (set 0 or the
        bare ViT) of the batch, fp32, summed per class."""
        assert self.proto_sums is not None and self.proto_counts is not None  # set by finish_set
        local = y - task.offset
        with torch.autocast(x.device.type, enabled=False):
            x = x.float()
            feats = vit_features(self.backbone, x)
            self.aligner.observe(feats, local)
            if self.proto_set() != self.sets.running:
                feats = self.branch_features(x, self.proto_set())
        self.proto_sums.index_add_(0, local, feats.double())
        self.proto_counts.index_add_(0, local, torch.ones_like(local, dtype=torch.float64))

    def observations(self) -> list[torch.Tensor]:
        rest = [t for t in (self.proto_sums, self.proto_counts) if t is not None]
        return self.aligner.observations() + rest

    # ----------------------------------------------------------------------------- inference
    def proto_set(self) -> int | None:
        """The prototype classifier's branch: set 0 (``forward_orig``) or the bare ViT."""
        return 0 if self.config.proto_branch == "adapter0" else None

    def branch_features(self, x: torch.Tensor, k: int | None) -> torch.Tensor:
        """phi_k(x): the ViT through set ``k`` (None: the pretrained ViT); one forward."""
        with self.sets.use(k):
            return vit_features(self.backbone, x)

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        return self.branch_features(x, 0 if task_id is None else task_id)

    def head_scores(self, feats: torch.Tensor) -> torch.Tensor:
        """Every seen head on ``feats``, fp32: the code's ``head`` sliced to the seen classes."""
        with torch.autocast(feats.device.type, enabled=False):
            return torch.cat([head(feats.float()) for head in self.heads], dim=1)

    def class_task(self, device: torch.device) -> torch.Tensor:
        """``cls2task``: each seen class's task."""
        return torch.cat([torch.full((t.num_classes,), t.id, device=device) for t in self.tasks[: self.num_seen]])

    def refine(self, branches: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Self-refinement, every image at once: from task ``start``, up to ``refine_rounds`` head evaluations on
        phi_i (``branches``: (B, tasks, d)); an image stops once its prediction's task is the one it was read from;
        returns each image's last logits."""
        owner, rows = self.class_task(branches.device), torch.arange(len(branches), device=branches.device)
        task, active = start, torch.ones_like(start, dtype=torch.bool)
        out = branches.new_zeros(len(branches), len(owner))
        for _ in range(self.config.refine_rounds):
            logits = self.head_scores(branches[rows, task])
            out = torch.where(active[:, None], logits, out)
            moved = owner[logits.argmax(1)]
            active = active & (moved != task)
            task = torch.where(active, moved, task)
        return out

    def cil_scores(self, x: torch.Tensor, branches: torch.Tensor, proto: torch.Tensor) -> torch.Tensor:
        """z_0 = cos(proto features, p_c), the refined logits from z_0's task, and their ensemble."""
        z0 = cosine_logits(proto, torch.cat([p.weight for p in self.prototypes[: self.num_seen]]))
        refined = self.refine(branches, self.class_task(x.device)[z0.argmax(1)])
        if not self.config.ensemble:
            return refined
        return F.softmax(refined, dim=1) + F.softmax(self.num_seen * z0, dim=1)

    def branches(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(phi_0(x) .. phi_t(x) as (B, tasks, d), the prototype branch's features): t + 1 forwards (t + 2 with the
        bare ViT's prototypes)."""
        branches = torch.stack([self.branch_features(x, k).float() for k in range(self.num_seen)], dim=1)
        proto = branches[:, 0] if self.proto_set() == 0 else self.branch_features(x, None).float()
        return branches, proto

    @torch.no_grad()
    def predict(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is not None:
            return self.heads[task_id](self.branch_features(x, task_id))
        return self.cil_scores(x, *self.branches(x))

    @torch.no_grad()
    def predict_scenarios(
        self, x: torch.Tensor, task_id: int, scenarios: tuple[str, ...], cil_classes: str = "seen"
    ) -> dict[str, torch.Tensor]:
        """CIL's pass through every set gives TIL's phi_{task_id} too (the same numbers as :meth:`predict`)."""
        if cil_classes == "all":
            raise ValueError("MOS has no logits for classes it has not trained")
        if "cil" not in scenarios:
            return {"til": self.predict(x, task_id)}
        branches, proto = self.branches(x)
        both = {"til": self.heads[task_id](branches[:, task_id]), "cil": self.cil_scores(x, branches, proto)}
        return {s: both[s] for s in scenarios}

    # ----------------------------------------------------------------------------- bookkeeping
    def forwards_per_test_image(self) -> dict[str, int]:
        """TIL: the task's set; CIL: every set, and the bare ViT for ``proto_branch=ptm``."""
        return {"til": 1, "cil": self.num_seen + int(self.proto_set() is None)}

    def storage(self) -> dict[str, Any]:
        """Per task: its adapter set and prefix sum, its head, its classes' prototypes, means and covariance factors
        (32-bit). Trainable: the newest task's set and head."""
        out = super().storage()
        d = self.backbone.num_features
        for t, entry in enumerate(out["bits_per_task"]):
            numel = self.sets.numel(t) if t < len(self.sets) else 0
            entry.update({"adapter": 32 * numel, "prefix_sum": 32 * numel})
            entry.update({"prototypes": 32 * self.tasks[t].num_classes * d}, **self.aligner.storage_bits(t))
        last = self.num_seen - 1
        head = sum(p.numel() for p in self.heads[last].parameters()) if last >= 0 else 0
        out["trainable_params"] = (self.sets.numel(last) if last >= 0 else 0) + head
        return out

    def extra_results(self) -> dict[str, Any]:
        c = self.config
        return {"mos": {"merge_mode": c.merge_mode, "adapter_init": c.adapter_init, "proto_branch": c.proto_branch}}

    def artifacts(self) -> dict[str, torch.Tensor]:
        protos = {f"prototypes.{t}": p.weight.detach().clone() for t, p in enumerate(self.prototypes)}
        return super().artifacts() | self.sums.state("sums.") | protos

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.sums.load(self.sets, tensors, "sums.")
        for t, head in enumerate(self.heads):
            self.prototypes.append(Prototypes(head.out_features, self.backbone.num_features, head.weight.device))
            self.prototypes[t].weight.copy_(tensors[f"prototypes.{t}"])
