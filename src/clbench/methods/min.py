"""MIN, Mixture of Noise (Jiang, Shi, Zhang, Zhang, Li, "Mixture of Noise for Pre-Trained Model-Based
Class-Incremental Learning", NeurIPS 2025): a frozen pretrained ViT with a Pi-Noise layer after every block
(:mod:`clbench.methods.parts.pinoise`) and an analytic head over random ReLU features. Official code
ASCIIJK/MiN-NeurIPS2025@292d883, read through its public forks (MiN/models/MiN.py, MiN/utils/inc_net.py,
MiN/backbones/ViT_MiN.py, MiN/configs/*).

The head: h(x) = ReLU(phi(x) W_B), W_B in R^{d x M} with U(+-1/sqrt(M)) entries (inc_net.py ``RandomBuffer``
L52-68), logits h(x) W with W = (sum h^T h + gamma I)^-1 sum h^T y over everything fitted so far, y one-hot over
every class (the code's recursive least squares, paper Eq. 2-4, solved from fp64 statistics:
:class:`~clbench.methods.parts.ridge.PassStatistics`). Per task t (the paper's Algorithm 1):

1. ``fit1..fitK``: K = ``fit_passes`` passes over the task's augmented training images into the statistics, through
   the network as it was after task t-1 (``fit_fc``, MiN.py L203-219; the code's 3); the head is solved.
2. ``noise``: a new generator pair in every layer, the mixture weights omega set, a zero auxiliary head W_aux over the
   seen classes; the generator and W_aux (and omega where it is learned) trained by SGD on
   CE(h(x) W + h(x) W_aux, y), W without gradient: W_aux fits the analytic head's residual (Eq. 14; ``run``
   L237-306, which reads the analytic logits in a second forward of the same network).
3. ``refit``: one pass over the task's training images through the test transform and the trained network into the
   statistics; the head is solved again, W_aux dropped (``re_fit`` L221-235).

A task's data thus enters the statistics K + 1 times, with two networks; old tasks' statistics are never recomputed.
CIL: the argmax of h(x) W over the seen classes; one ViT forward per test image whatever the number of tasks.

The paper and its code differ; a key each, and ``results.json``'s ``min.variant`` says which ran (``paper``,
``official`` or ``mixed``):

- ``noise_sampling``: the paper draws xi ~ N(0, I) and trains through it (Eq. 8-9); the code draws nothing and adds
  mu + sigma (ViT_MiN.py L137-154).
- ``omega``: ``learned``, the paper's (Eq. 11-13: omega_i = softmax_i(cos(p_t, p_i) / tau) over i <= t, then trained
  with the generator: "Optimize the omega, P_t and W_aux via Eq. (14)"); ``code``: fixed, never trained: 0 at tasks 0
  and 1, afterwards softmax([cos(p_{t-1}, p_i)]_{i<t} + [1]) with p_i taken after task i's training (MiN.py L330-340,
  ViT_MiN.py L112-128). p_i: task i's prototype, the mean phi over its augmented training images.
- ``task0_tuning``: the code's first task, absent from the paper: no fit before training; a residual d x d MLP per
  layer, every LayerNorm's affine (each block's norm1 and norm2, the final norm) and a fresh linear head with bias
  over the first task's classes trained by cross-entropy (``init_train`` L98-147, inc_net.py ``init_unfreeze``
  L193-202); then the prototype, the fit passes and the refit.
- the schedule is the trainer's: cosine to 0 (paper §5.1, App. B) or constant (the code's "step", MultiStepLR at
  epochs 70 and 100, which 10 or 20 epochs never reach: training_tool.py L40-44).

The default is the paper's method: sampled noise, learned omega (tau 2), no first-task tuning, cosine schedule; the
code's is ``experiment=min_<data>_official``. Where the paper is silent the default takes a reading of its own, and
results.json marks every setting but the code's ``reconstructed``: evaluation and the head's passes take the noise's
mean (xi = 0, the mu's mixture), one xi per layer and token is shared by the generators (Eq. 8's single signal), one
omega by the layers, p_t comes from the first fit pass (the network before P_t), learned omega is left unconstrained
after its initialisation, the fit passes are the code's, and the first task runs as every other (its omega is [1]).
Both readings draw W_down and W_up as the code does (the paper's N(0, 1) entries would scale the noise path about 24
and 48 times at the same learning rate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.methods.base import Logs, Method, Phase
from clbench.methods.first_session import vit_features
from clbench.methods.parts.pinoise import NoiseLayers, uniform_fan_in
from clbench.methods.parts.ridge import PassStatistics, RidgeStatistics, relu_features, ridge_head, ridge_logits


@dataclass
class MINConfig:
    OMEGAS: ClassVar[tuple[str, ...]] = ("learned", "code")
    hidden_dim: int = 192  # d2, the generators' width (configs hidden_dim 192; paper §5.1)
    M: int = 16384  # random ReLU features of the analytic head (configs buffer_size 16384)
    gamma: float = 100.0  # the head's ridge (configs gamma: 100 CIFAR, CUB; 500 ImageNet-R, FOOD, OmniBenchmark)
    fit_passes: int = 3  # augmented passes into the head before the noise trains (configs fit_epochs 3)
    init_epochs: int | None = None  # the first task's noise epochs (configs init_epochs; null: trainer.epochs)
    noise_sampling: bool = True  # the paper's xi ~ N(0, I) while training | false: the code's mu + sigma
    omega: str = "learned"  # learned (paper Eq. 11-13) | code (fixed; 0 at tasks 0 and 1)
    tau: float = 2.0  # omega=learned: the softmax temperature (paper Eq. 12, "set to 2 by default")
    task0_tuning: bool = False  # the code's first task: residual MLPs, LayerNorms and a fresh head, no fit before
    projection_seed: int | None = None  # seed of W_B, W_down and W_up (null: the run's seed)

    def __post_init__(self) -> None:
        require_choice("method.omega", self.omega, self.OMEGAS)
        for key in ("hidden_dim", "M"):
            value = getattr(self, key)
            require(isinstance(value, int) and value >= 1, f"method.{key}", value, "an integer >= 1")
        require(isinstance(self.fit_passes, int) and self.fit_passes >= 0, "method.fit_passes", self.fit_passes,
                "an integer >= 0")  # fmt: skip
        init = self.init_epochs
        require(init is None or (isinstance(init, int) and init >= 0), "method.init_epochs", init, "null or >= 0")
        require(self.gamma > 0, "method.gamma", self.gamma, "> 0")
        require(self.tau > 0, "method.tau", self.tau, "> 0")

    @property
    def variant(self) -> str:
        """Which reading the rules follow: ``official`` (the code's), ``paper`` (the defaults) or ``mixed``."""
        code = (not self.noise_sampling, self.omega == "code", self.task0_tuning)
        return "official" if all(code) else "paper" if not any(code) else "mixed"


class MIN(Method):
    """``heads[t]`` holds the analytic head's rows of task ``t``'s classes over h (in_features M); ``noise`` the
    Pi-Noise layers hooked onto the backbone's blocks; ``aux`` W_aux while a task's noise trains."""

    Config = MINConfig
    changes_backbone = False  # the pretrained weights stay; the first task's tuned norms are saved on their own

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: MINConfig) -> None:
        super().__init__(backbone, benchmark, config)
        backbone.requires_grad_(False)
        self.reconstructed = config.variant != "official"  # results.json: the paper completed where it is silent
        self.num_classes = benchmark.num_classes
        device = backbone.pos_embed.device
        seed = torch.initial_seed() if config.projection_seed is None else config.projection_seed
        self.register_buffer("projection_seed", torch.tensor(seed % 2**63, dtype=torch.long))
        self.register_buffer("projection", self.draw_projection(), persistent=False)
        self.noise = NoiseLayers(backbone, config.hidden_dim, residual_mlp=config.task0_tuning, seed=self.seeds(1))
        self.noise.requires_grad_(False)
        tasks = len(self.tasks)
        self.register_buffer("prototypes", torch.zeros(tasks, backbone.num_features, device=device))
        self.register_buffer("omegas", torch.zeros(tasks, tasks, device=device))  # row t: omega after task t
        self.stats = RidgeStatistics(device)  # allocated at the first pass that observed something
        self.pass_stats: PassStatistics | None = None  # the observe pass's, until the ranks have summed them
        self.proto_sums: list[torch.Tensor] | None = None  # the prototype pass's sum of phi and its count
        self.fitting = self.prototyping = False  # what the current observe pass sums
        self.stale = False  # statistics folded in since the last solve
        self.aux: nn.Linear | None = None
        self.trained: list[nn.Parameter] = []
        self.register_load_state_dict_post_hook(lambda module, keys: module.redraw())

    @staticmethod
    def unused_keys(config: MINConfig) -> dict[str, str]:
        return {"method.tau": "method.omega=code"} if config.omega == "code" else {}

    # ----------------------------------------------------------------------------- the fixed random matrices
    def seeds(self, stream: int) -> int:
        """Stream 0 draws W_B, stream 1 the Pi-Noise layers' W_down and W_up."""
        return hash((int(self.projection_seed), stream)) % 2**63

    def draw_projection(self) -> torch.Tensor:
        """W_B (d x M), U(+-1/sqrt(M))."""
        weights = uniform_fan_in(self.backbone.num_features, self.config.M, self.seeds(0))
        return weights.to(self.backbone.pos_embed.device)

    def redraw(self) -> None:
        """Every fixed matrix from the (loaded) seed."""
        self.projection = self.draw_projection()
        self.noise.redraw(self.seeds(1))

    # ----------------------------------------------------------------------------- lifecycle
    def new_head(self, num_classes: int) -> nn.Linear:
        return ridge_head(self.config.M, num_classes, self.backbone.pos_embed.device)

    def tuned_first(self, task: Task) -> bool:
        return task.id == 0 and self.config.task0_tuning

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        """fit passes, noise, refit; with ``omega=code`` a prototype pass after the noise; the code's first task:
        noise, prototype, fit passes, refit (``init_train``)."""
        cfg = self.config
        fits = [Phase(f"fit{k + 1}", 1, observe=True, augment=True) for k in range(cfg.fit_passes)]
        prototype = Phase("prototype", 1, observe=True, augment=True)
        first = self.tuned_first(task)
        before = [] if first else fits
        if cfg.omega == "learned" and not before:
            before = [prototype]  # p_t through the network before P_t
        after = ([prototype] if cfg.omega == "code" else []) + (fits if first else [])
        noise = Phase("noise", cfg.init_epochs if task.id == 0 and cfg.init_epochs is not None else epochs)
        return [*before, noise, *after, Phase("refit", 1, observe=True)]

    def prototype_phase(self, task: Task) -> str:
        """The pass whose phi gives p_t: the prototype pass, or (omega learned) the first fit pass."""
        return "prototype" if any(p.name == "prototype" for p in self.phases(task, 1)) else "fit1"

    def before_phase(self, task: Task, phase: Phase) -> None:
        self.settle(task)
        if phase.name == "noise":
            self.start_noise(task)
        elif phase.observe:
            self.fitting = phase.name != "prototype"
            self.prototyping = phase.name == self.prototype_phase(task)

    def pass_sums(self) -> tuple[PassStatistics | None, list[torch.Tensor] | None]:
        """The observe pass's sums, allocated at its first batch (or, on a rank that saw none, when the ranks add them
        up): a pass walked without data (a replay, the random-init probe) allocates nothing."""
        device = self.backbone.pos_embed.device
        if self.fitting and self.pass_stats is None:
            self.pass_stats = PassStatistics(self.config.M, self.num_classes, device)
        if self.prototyping and self.proto_sums is None:
            f64 = {"dtype": torch.float64, "device": device}
            self.proto_sums = [torch.zeros(self.backbone.num_features, **f64), torch.zeros((), **f64)]
        return self.pass_stats, self.proto_sums

    @torch.no_grad()
    def settle(self, task: Task) -> None:
        """After an observe pass (its sums added over the ranks): its statistics into G and Q, its prototype into
        p_t. A pass that saw nothing (a checkpoint's replay, the random-init probe) changes neither."""
        if self.pass_stats is not None and int(self.pass_stats.count):
            self.stats.allocate(self.config.M, self.num_classes, self.backbone.pos_embed.device)
            self.pass_stats.fold_into(self.stats)
            self.stale = True
        if self.proto_sums is not None and int(self.proto_sums[1]):
            self.prototypes[task.id] = (self.proto_sums[0] / self.proto_sums[1]).float()
        self.pass_stats = self.proto_sums = None
        self.fitting = self.prototyping = False

    @torch.no_grad()
    def solve(self) -> None:
        """The head of every seen class from the statistics, where they changed."""
        if self.stale:
            self.stats.write_heads(self.config.gamma, self.heads, self.tasks)
            self.stale = False

    def start_noise(self, task: Task) -> None:
        """The head solved; task t's generators, omega and W_aux; what the noise phase trains."""
        self.solve()
        learned = self.config.omega == "learned"
        self.noise.expand(self.mixture_weights(task), trainable=learned)
        first = self.tuned_first(task)
        seen = task.offset + task.num_classes
        self.aux = nn.Linear(self.config.M, seen, bias=first, device=self.backbone.pos_embed.device)
        nn.init.zeros_(self.aux.weight)
        if first:
            nn.init.zeros_(self.aux.bias)
        self.trained = [*self.noise.newest(), *self.aux.parameters()]
        self.trained += [self.noise.omega] if learned else []
        self.trained += [*self.noise.mlps(), *self.tuned_norms()] if first else []
        self.noise.requires_grad_(False)
        for p in self.trained:
            p.requires_grad_(True)

    def mixture_weights(self, task: Task) -> torch.Tensor:
        """omega for task t's generators 0..t: Eq. 12 (learned) or the code's rule."""
        t, protos = task.id, self.prototypes
        if self.config.omega == "learned":
            cos = F.cosine_similarity(protos[t : t + 1], protos[: t + 1])
            return torch.softmax(cos / self.config.tau, dim=0)
        if t <= 1:
            return torch.zeros(t + 1, device=protos.device)
        cos = F.cosine_similarity(protos[t - 1 : t], protos[:t])
        return torch.softmax(torch.cat([cos, cos.new_ones(1)]), dim=0)

    def tuned_norms(self) -> list[nn.Parameter]:
        """The LayerNorm affines the code's first task trains: each block's norm1 and norm2 and the final norm."""
        vit = self.backbone
        norms = [m for block in vit.blocks for m in (block.norm1, block.norm2)] + [vit.norm, vit.fc_norm]
        return [p for m in norms for p in m.parameters()]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        return [{"params": self.trained}]

    def no_weight_decay_ids(self) -> set[int]:
        """None: the code's SGD decays every trained parameter (training_tool.py L6-13)."""
        return set()

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """CE over the seen classes of h W (no gradient) + h W_aux, h through the noise (sampled where the paper
        samples it, for the whole batch: this rank keeps its rows)."""
        assert self.aux is not None  # set by before_phase
        if self.config.noise_sampling:
            self.noise.share = self.batch_share or (len(x), slice(None))
        try:
            h = self.features(x, task.id)
        finally:
            self.noise.share = None
        with torch.autocast(h.device.type, enabled=False):
            logits = self.seen_logits(h.detach()) + self.aux(h)
        return F.cross_entropy(logits, y), {"omega_newest": self.noise.omega[-1].detach()}

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        stats, proto = self.pass_sums()
        phi = vit_features(self.backbone, x)
        if stats is not None:
            stats.observe(relu_features(phi, self.projection), y)
        if proto is not None:
            proto[0] += phi.double().sum(0)
            proto[1] += len(y)

    def observations(self) -> list[torch.Tensor]:
        stats, proto = self.pass_sums()
        return [*(stats.sums() if stats else []), *(proto or [])]

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """The refit folded in and the head solved; omega recorded; W_aux dropped; everything frozen."""
        self.settle(task)
        self.solve()
        if self.noise.tasks > task.id:
            self.omegas[task.id, : task.id + 1] = self.noise.omega.detach()
        self.aux, self.trained = None, []
        self.noise.requires_grad_(False)
        self.backbone.requires_grad_(False)

    # ----------------------------------------------------------------------------- inference
    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """h(x) = ReLU(phi(x) W_B), phi through the Pi-Noise layers."""
        return relu_features(vit_features(self.backbone, x), self.projection)

    def head_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        return ridge_logits(feats, self.heads[task_id])

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: its head rows (32-bit, M a class), its classes' columns of Q (64-bit), its generators in every
        layer and its prototype (32-bit). Shared: G (64-bit, M x M), omega, the seed the fixed matrices are drawn
        from (64 bits), and with the first task's tuning the residual MLPs and the tuned LayerNorms."""
        m, d = self.config.M, self.backbone.num_features
        per_task = [
            {"head": 32 * head.weight.numel(), "Q_columns": 64 * m * head.out_features,
             "generators": 32 * self.noise.generator_numel(), "prototype": 32 * d}
            for head in self.heads
        ]  # fmt: skip
        shared = {"G": 64 * m * m, "omega": 32 * self.noise.omega.numel(), "projection_seed": 64}
        if self.config.task0_tuning:
            shared |= {"residual_mlps": 32 * sum(p.numel() for p in self.noise.mlps()),
                       "norms": 32 * sum(p.numel() for p in self.tuned_norms())}  # fmt: skip
        return {"bits_per_task": per_task, "shared_bits": shared, "trainable_params": self.kept_trained_numel()}

    def kept_trained_numel(self) -> int:
        """What MIN trains and keeps: every task's generators (and its omega where learned), the first task's MLPs
        and norms; the auxiliary heads, trained and dropped, aside."""
        seen = self.num_seen
        count = seen * self.noise.generator_numel() + (seen if self.config.omega == "learned" else 0)
        if self.config.task0_tuning and seen:
            count += sum(p.numel() for p in [*self.noise.mlps(), *self.tuned_norms()])
        return count

    def extra_results(self) -> dict[str, Any]:
        """Which reading ran, omega after each task, the head's size and ridge, the fixed matrices' seed."""
        cfg = self.config
        omegas = [self.omegas[t, : t + 1].tolist() for t in range(self.num_seen)]
        return {
            "min": {
                "variant": cfg.variant,
                "noise_sampling": cfg.noise_sampling,
                "omega": cfg.omega,
                "task0_tuning": cfg.task0_tuning,
                "omega_per_task": omegas,
                "M": cfg.M,
                "gamma": cfg.gamma,
                "projection_seed": int(self.projection_seed),
            }
        }

    def artifacts(self) -> dict[str, torch.Tensor]:
        own = {f"noise.{k}": v for k, v in self.noise.state_dict().items()}
        own |= {"projection_seed": self.projection_seed, "omegas": self.omegas, "prototypes": self.prototypes}
        if self.config.task0_tuning:
            norms = {id(p) for p in self.tuned_norms()}
            own |= {f"norms.{k}": p for k, p in self.backbone.named_parameters() if id(p) in norms}
        return super().artifacts() | {k: v.detach().clone() for k, v in own.items()}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for name in ("projection_seed", "omegas", "prototypes"):
            getattr(self, name).copy_(tensors[name])
        self.noise.expand(tensors["noise.omega"], trainable=False)
        self.noise.load_state_dict({k.removeprefix("noise."): v for k, v in tensors.items() if k.startswith("noise.")})
        saved = {k.removeprefix("norms."): v for k, v in tensors.items() if k.startswith("norms.")}
        for name, p in self.backbone.named_parameters():
            if name in saved:
                p.copy_(saved[name])
        self.noise.requires_grad_(False)
        self.redraw()
