"""RanPAC (McDonnell, Gong, Parvaneh, Abbasnejad, van den Hengel, "RanPAC: Random Projections and Pre-trained Models
for Continual Learning", NeurIPS 2023): a pretrained ViT adapted on the first task only, then a ridge-regression head
over random ReLU features of its frozen features, refitted in closed form after every task. Official code
RanPAC/RanPAC@012927f (RanPAC.py, inc_net.py, petl/*.py, args/*_publish.csv).

Phase 1 (task 0 only, ``_train`` L225-238): a parameter-efficient module (AdaptFormer adapter, SSF or deep VPT; the
args' PETL per benchmark) and a sigma-scaled cosine head over task 0's classes trained with cross-entropy by SGD
(:mod:`clbench.methods.first_session`); then all is frozen and the head thrown away.

Phase 2 (every task, ``replace_fc`` L91-136), one pass over the task's training images through the test transform:
h(x) = ReLU(phi(x) W), W in R^{d x M} ~ N(0, 1) drawn once (from a seed); G += sum h^T h, Q += sum h^T y (y one-hot over
all classes); lambda chosen from 10^-8 .. 10^8 on the task's own rows (80% fit, 20% held out, the lowest held-out mean
squared error); the head W_o = ((G + lambda I)^{-1} Q)^T by a linear solve, rows of every seen class rewritten (old
classes' rows change with every task). Logits: h(x) · W_o[c] (the code's sigma of a fresh head is 1). CIL: argmax
over the seen classes; one forward per test image. ``petl: none`` is the paper's "No Phase 1" ablation, ``M: 0``
(ridge on phi itself) its "No RPs".

Where the statistics live: G (M x M) and Q (M x C) are fp64 buffers on the training device (800 MB and 24 MB at
M = 10,000, C = 300), in the checkpoint (to go on training) but not in the run's artifacts (evaluation needs the heads,
the adapted module and the projection's seed). While a task is observed, its fitting rows' G and Q and its held-out
rows (20%, n x M) are kept beside them and folded in after the task: the peak is about three M x M fp64 matrices
(2.4 GB at M = 10,000) plus the solver's copy. The code keeps fp32 G and Q on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require
from clbench.data import Benchmark, Task
from clbench.methods.base import Phase
from clbench.methods.first_session import FirstSession, FirstSessionConfig, FirstSessionLearner, vit_features
from clbench.methods.parts import petl
from clbench.methods.parts.ridge import (
    RIDGES,
    HoldoutStatistics,
    RidgeStatistics,
    random_projection,
    relu_features,
    ridge_head,
    ridge_logits,
    select_ridge,
)


@dataclass
class RanPACConfig(FirstSessionConfig):
    CHOICES = (*petl.KINDS, "none")
    petl: str = "adapter"  # adapter | ssf | vpt_deep | vpt_shallow | none (no Phase 1, the paper's ablation)
    M: int = 10000  # random features; 0: the ridge on phi itself (the paper's "No RPs")
    ridge: float | None = None  # null: chosen per task from 10^-8..10^8 (the code); a float fixes lambda
    fit_fraction: float = 0.8  # of a task's rows fitting lambda's candidates, the rest held out (the code: 0.8)
    rp_seed: int | None = None  # seed of the projection W (null: the run's seed)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.M, int) and self.M >= 0, "method.M", self.M, "an integer >= 0")
        require(self.ridge is None or self.ridge > 0, "method.ridge", self.ridge, "null or > 0")
        require(0 < self.fit_fraction < 1, "method.fit_fraction", self.fit_fraction, "in (0, 1)")


class RanPAC(FirstSessionLearner):
    """``heads[t]`` holds the ridge head's rows of task ``t``'s classes over h (in_features M); ``features`` is h."""

    Config = RanPACConfig
    changes_backbone = False  # the pretrained weights never change; the adapted module is saved on its own

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: RanPACConfig) -> None:
        super().__init__(backbone, benchmark, config)
        backbone.requires_grad_(False)
        self.first = FirstSession(backbone, config, benchmark.tasks[0].num_classes)
        self.num_classes = benchmark.num_classes
        self.train_sizes = [len(split) for split in benchmark.train]
        seed = torch.initial_seed() if config.rp_seed is None else config.rp_seed
        self.register_buffer("rp_seed", torch.tensor(seed % 2**63, dtype=torch.long))
        self.register_buffer("projection", self.draw_projection(), persistent=False)
        self.register_buffer("ridges", torch.zeros(len(self.tasks), dtype=torch.float64))  # lambda per task
        # each candidate's held-out error per task (zeros where lambda is fixed)
        self.register_buffer("holdout_mse", torch.zeros(len(self.tasks), len(RIDGES), dtype=torch.float64))
        self.stats = RidgeStatistics()
        self.task_stats: HoldoutStatistics | None = None
        self.register_load_state_dict_post_hook(lambda module, keys: module.redraw_projection())

    # ----------------------------------------------------------------------------- the random projection
    @property
    def width(self) -> int:
        """The head's input width: M, or d without the projection."""
        return self.config.M or self.backbone.num_features

    def draw_projection(self) -> torch.Tensor | None:
        if not self.config.M:
            return None
        weights = random_projection(self.backbone.num_features, self.config.M, int(self.rp_seed))
        return weights.to(self.backbone.pos_embed.device)

    def redraw_projection(self) -> None:
        """W from the (loaded) seed."""
        if self.config.M:
            self.projection = self.draw_projection()

    def expand(self, feats: torch.Tensor) -> torch.Tensor:
        return relu_features(feats, self.projection) if self.projection is not None else feats.float()

    # ----------------------------------------------------------------------------- lifecycle
    def new_head(self, num_classes: int) -> nn.Linear:
        """A task's rows of W_o over the M features (filled by the solve; the bias stays 0)."""
        return ridge_head(self.width, num_classes, self.backbone.pos_embed.device)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        stats = Phase("statistics", 1, observe=True)  # the test transform (train_loader_for_CPs, mode="test")
        return [Phase("adapt", epochs), stats] if task.id == 0 and self.first.kind != "none" else [stats]

    def before_phase(self, task: Task, phase: Phase) -> None:
        if phase.name != "statistics":
            return
        self.first.freeze()  # freeze_backbone() after Phase 1
        device = self.backbone.pos_embed.device
        self.stats.allocate(self.width, self.num_classes, device)
        seed = hash((int(self.rp_seed), task.id)) % 2**63
        rows, fit = self.train_sizes[task.id], self.config.fit_fraction
        self.task_stats = HoldoutStatistics(self.width, self.num_classes, rows, fit=fit, seed=seed, device=device)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        assert self.task_stats is not None  # set by before_phase
        self.task_stats.observe(self.features(x, task.id), y, rows)

    def observations(self) -> list[torch.Tensor]:
        return self.task_stats.sums() if self.task_stats is not None else []

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """Fold the task into G and Q, choose lambda on its rows, solve, rewrite every seen class's head rows. A task
        walked through without data (a checkpoint's replay, the random-init probe) changes nothing."""
        task_stats, self.task_stats = self.task_stats, None
        if task_stats is None or not int(task_stats.count):
            return
        ridge = self.config.ridge
        if ridge is None:
            ridge, losses = select_ridge(
                task_stats.gram, task_stats.cross, task_stats.held, task_stats.targets(), RIDGES
            )
            self.holdout_mse[task.id] = torch.tensor(losses, dtype=torch.float64)
        self.ridges[task.id] = ridge
        task_stats.fold_into(self.stats)
        del task_stats
        self.stats.write_heads(ridge, self.heads, self.tasks)  # L125-126: the rows of every seen class

    # ----------------------------------------------------------------------------- inference
    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """h(x) = ReLU(phi(x) W) of the adapted ViT's features (phi itself without the projection)."""
        return self.expand(vit_features(self.backbone, x))

    def head_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        """h(x) · W_o[c] in fp32 whatever the autocast."""
        return ridge_logits(feats, self.heads[task_id])

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: its head rows (32-bit, M per class) and its classes' columns of Q (64-bit). Shared: the adapted
        module (32-bit), G (64-bit, M x M) and the projection's seed (64 bits: W is drawn from it)."""
        m = self.width
        per_task = [{"head": 32 * head.weight.numel(), "Q_columns": 64 * m * head.out_features} for head in self.heads]
        shared = {"adapted_module": 32 * self.first.adapted_numel(), "G": 64 * m * m}
        if self.config.M:
            shared["projection_seed"] = 64
        return {"bits_per_task": per_task, "shared_bits": shared, "trainable_params": self.trained_numel()}

    def trained_numel(self) -> int:
        """What the first session trains: the module and the cosine head (none without Phase 1)."""
        return 0 if self.first.kind == "none" else sum(p.numel() for p in self.first.trained())

    def extra_results(self) -> dict[str, Any]:
        """lambda per task (and, where it was chosen, each candidate's held-out error), the projection's seed and
        width."""
        out = {"M": self.config.M, "rp_seed": int(self.rp_seed)}
        out["ridge_per_task"] = self.ridges[: self.num_seen].tolist()
        if self.config.ridge is None:
            out["ridge_candidates"] = list(RIDGES)
            out["holdout_mse"] = self.holdout_mse[: self.num_seen].tolist()
        return {"ranpac": out}

    def artifacts(self) -> dict[str, torch.Tensor]:
        own = {"rp_seed": self.rp_seed, "ridges": self.ridges, "holdout_mse": self.holdout_mse}
        return super().artifacts() | self.first.state() | {k: v.clone() for k, v in own.items()}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.first.load(tensors)
        self.first.freeze()
        for name in ("ridges", "holdout_mse", "rp_seed"):
            getattr(self, name).copy_(tensors[name])
        self.redraw_projection()
