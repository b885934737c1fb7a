"""HiDe-Prompt, Hierarchical Decomposition of prompt-based continual learning (Wang, Xie, Zhang, Huang, Su, Zhu,
"Hierarchical Decomposition of Prompt-Based Continual Learning: Rethinking Obscured Sub-optimality", NeurIPS 2023), with
HiDe-LoRA (the same framework over per-task LoRA slots, arXiv 2310.13888) as ``peft=lora``. Official code
thu-ml/HiDe-Prompt@0ed4333: engines/hide_tii_engine.py (TII), engines/hide_promtp_wtp_and_tap_engine.py (prompts),
engines/hide_lora_wtp_and_tap_engine.py (LoRA), peft/prompt/hide_prompt.py, peft/lora/hide_lora.py,
vits/hide_{prompt,lora}_vision_transformer.py, configs/*, training_scripts/*.sh.

The code runs two programs; here they are the phases of one task t, over one frozen pretrained ViT:

- Task-identity inference, TII (phases ``tii_train``, ``tii_stats``, ``tii_align``): the frozen ViT's pre-logit
  feature f, an MLP g(f) = LN(f + W2 GELU(W1 f)) (W1: d -> 2d, W2: 2d -> d; :class:`MlpMapping`, vit L321-369) and a
  TII head a task. The MLP and the task's TII head train with Adam, cross-entropy over the task's classes (the other
  logits at -inf), clipped at norm 1, at their own lr (``tii.lr``, the code's lr after its x batch/256 scaling). Then
  the statistics of f for each of the task's classes (ten k-means clusters a class, each a mean and per-dimension
  variance: ``multi-centroid``, engine L158-202), and from t >= 1 the MLP and every TII head align on samples of them
  (:mod:`~clbench.methods.parts.gaussian_alignment`; SGD, cosine over 30 epochs, L280-387).
- Within-task prediction, WTP (phase ``train``): the prompted ViT with task t's slot. ``peft=prompt``: an E-prompt a
  task, prefix-tuned in blocks ``layers`` (0-4), ``length`` key and value vectors each (hide_prompt.py L39-45,
  attention.py L18-44), uniform(-1, 1) at the start; slot t starts as a copy of slot t-1 (engine L256-284); with
  ``prompt_momentum`` m > 0 and t >= 1 the forward uses (1 - m) P_t + m mean(P_0..P_{t-1}) (the mean without
  gradient; hide_prompt.py L105-112), and after training the slot is replaced by that mixture (engine L315-324).
  ``peft=lora``: a LoRA pair a task on k and v of the same blocks, Δ(x) = B A x / r (A U(±1/sqrt(r)), B = 0;
  hide_lora.py L19-78), slot t copied from slot t-1, and after training A and B each replaced by
  (1 - m) X_t + m mean(X_<t) (``lora_momentum``, lora engine L221-268). Loss: cross-entropy over the task's classes
  + ``reg`` x L_proto, L_proto the cross-entropy of the rows of M M^T / 0.8 to their diagonal, M = [every stored
  centroid of the earlier tasks; the batch's prompted pre-logits] (engine L528-547). Adam at the run's lr for the slot
  and ``head_lr_scale`` (0.1) x it for the head (``--larger_prompt_lr``, hideprompt_trainer.py L105-113), clip 1.
- Task-adaptive prediction, TAP (phases ``tap_stats``, ``tap_align``): statistics of the prompted pre-logits of each
  new class through its own slot, and from t >= 1 the heads align on samples of every seen class (SGD lr 0.005
  unscaled, momentum 0.9, cosine over 30 epochs, L418-525).
- Prediction (engine L99-166): TII's argmax over the seen classes names a task î per image; the prompted ViT with slot
  î, and the heads over the seen classes (``trainer.cil_classes=all``: every class of the benchmark, as the code's
  one head over nb_classes whose untrained rows join the argmax). Two ViT forwards a CIL image; TIL reads the given
  task's slot and head (one forward).

Options for the official code's paths (results.json's config records them):

- ``prefix_layout``: ``correct`` gives each image its own slot's key and value prefixes; ``official_reshape`` the
  code's reshape of the selected prompts (layers, 2, B, ...) to (layers, B, 2, ...) without swapping axes
  (hide_prompt.py L114-119, inherited from dualprompt-pytorch), so that image b's key and value prefixes come from
  images 2b and 2b + 1's slots, key halves first: a prediction depends on its batch (a batch-level option).
- ``ca_steps``: ``old_classes``, the code's one batch per old class an alignment epoch (the current task's classes
  left out of the count: a share of the drawn samples is used), or ``seen_classes``, one batch per seen class.
- ``trainer.cil_classes``: ``all`` is the code's CIL argmax over every class (untrained rows included), ``seen``
  clbench's default.

Departures (docs): k-means with a fixed seed (the code seeds none); statistics in fp32 buffers where the code keeps
fp64; every rank draws the whole alignment set and trains on its share (the code: each rank its own draws); one
program, where the code trains TII and WTP as two runs and reloads TII's checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Split, Task
from clbench.methods.base import HEAD_INITS, Logs, Method, Phase, init_head
from clbench.methods.parts import lora
from clbench.methods.parts.gaussian_alignment import AlignmentConfig, GaussianAligner
from clbench.methods.prompting import PromptMethod, prompt_init, within_depth, wrap_prefix_layers

CA_STEPS = {"old_classes": "old", "seen_classes": "seen"}


@dataclass
class TIIConfig:
    """The TII stage's training (tii_trainer.py, training_scripts/*.sh): Adam, clip 1, lr after the x bs/256 scaling."""

    epochs: int = 20  # (scripts)
    optimizer: str = "adam"  # --opt adam, betas (0.9, 0.999) | sgd (momentum 0.9)
    lr: float = 4.6875e-5  # 0.0005 x 24/256 (unscale_lr: per-device batch 24)
    schedule: str = "constant"  # constant (CIFAR; ImageNet-R's step decays after its 20 epochs) | multistep | cosine
    milestones: list[int] = field(default_factory=list)  # multistep: the epochs from which lr x 0.1 (--decay-epochs)
    grad_clip: float | None = 1.0  # --clip-grad 1.0
    hidden: int = 2  # MlpMapping's hidden width in multiples of d (mlp_structure [2])

    def __post_init__(self) -> None:
        require(self.epochs >= 1, "method.tii.epochs", self.epochs, "an integer >= 1")
        require(self.lr > 0, "method.tii.lr", self.lr, "a float > 0")
        require_choice("method.tii.optimizer", self.optimizer, ("adam", "sgd"))
        require_choice("method.tii.schedule", self.schedule, ("constant", "multistep", "cosine"))
        require(self.grad_clip is None or self.grad_clip > 0, "method.tii.grad_clip", self.grad_clip, "null or > 0")
        require(self.hidden >= 1, "method.tii.hidden", self.hidden, "an integer >= 1")


def official_alignment(per_centroid: int, lr: float) -> AlignmentConfig:
    """HiDe's alignment: multi-centroid (10) statistics, no mean shrink, plain cross-entropy over the seen classes,
    SGD momentum 0.9 without weight decay (the group's args.weight_decay, 0.0), cosine over 30 epochs, kept after."""
    return AlignmentConfig(
        epochs=30, samples_per_class=per_centroid, batch_size=per_centroid, covariance="diagonal",
        mean_shrink="none", logit_norm=None, lr=lr, momentum=0.9, weight_decay=0.0, restore=False, centroids=10,
    )  # fmt: skip


@dataclass
class HiDeConfig:
    peft: str = "prompt"  # prompt: HiDe-Prompt's E-prompt slots | lora: HiDe-LoRA's k/v LoRA slots
    layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])  # e_prompt_layer_idx / lora_depth 5
    length: int = 20  # E-prompt length (ImageNet-R 20, CIFAR-100 5)
    prompt_momentum: float = 0.01  # m of the prompt mixture (scripts)
    prefix_layout: str = "correct"  # correct | official_reshape (the code's batch-mixing reshape)
    prompt_init: str = "uniform"  # uniform: U(-1, 1) (hide_prompt.py L39-45) | small: U(0, 0.01)
    lora_rank: int = 5  # r (IN-R script)
    lora_momentum: float = 0.1  # m of the LoRA mixture (IN-R script)
    reg: float = 0.5  # weight of L_proto (IN-R 0.5, CIFAR-100 0.1)
    proto_temperature: float = 0.8  # the divisor of M M^T (engine L541)
    # L_proto over this many equal groups of the batch, each with every centroid, averaged: the code's is each GPU's
    # loss on its 24 images, averaged by DDP over its 8 (the presets: 8); 1 takes the whole batch at once. Under
    # several processes each rank groups its share: one process's grouping where a share is a whole number of groups
    proto_groups: int = 1
    head_lr_scale: float = 0.1  # the head's lr as a share of the slot's (--larger_prompt_lr)
    head_init: str = "trunc_normal"  # timm's N(0, 0.02), bias 0 (the code's ViT init of its heads)
    ca_steps: str = "seen_classes"  # seen_classes | old_classes (the code's count)
    tii: TIIConfig = field(default_factory=TIIConfig)
    tii_alignment: AlignmentConfig = field(default_factory=lambda: official_alignment(24, 4.6875e-4))
    tap_alignment: AlignmentConfig = field(default_factory=lambda: official_alignment(120, 0.005))

    def __post_init__(self) -> None:
        require_choice("method.peft", self.peft, ("prompt", "lora"))
        ok = len(self.layers) > 0 and all(isinstance(i, int) and i >= 0 for i in self.layers)
        require(ok, "method.layers", self.layers, "a non-empty list of block indices")
        for key in ("length", "lora_rank"):
            require(getattr(self, key) >= 1, f"method.{key}", getattr(self, key), "an integer >= 1")
        for key in ("prompt_momentum", "lora_momentum"):
            require(0 <= getattr(self, key) <= 1, f"method.{key}", getattr(self, key), "a float in [0, 1]")
        require_choice("method.prefix_layout", self.prefix_layout, ("correct", "official_reshape"))
        require_choice("method.prompt_init", self.prompt_init, ("uniform", "small"))
        require(self.reg >= 0, "method.reg", self.reg, "a float >= 0")
        require(self.proto_temperature > 0, "method.proto_temperature", self.proto_temperature, "a float > 0")
        require(self.proto_groups >= 1, "method.proto_groups", self.proto_groups, "an integer >= 1")
        require(self.head_lr_scale > 0, "method.head_lr_scale", self.head_lr_scale, "a float > 0")
        require_choice("method.head_init", self.head_init, HEAD_INITS)
        require_choice("method.ca_steps", self.ca_steps, tuple(CA_STEPS))
        for key in ("tii_alignment", "tap_alignment"):
            steps = getattr(self, key).steps
            ok = steps in ("all", CA_STEPS[self.ca_steps])
            require(ok, f"method.{key}.steps", steps, f"unset: method.ca_steps={self.ca_steps} sets it")
            getattr(self, key).steps = CA_STEPS[self.ca_steps]


class MlpMapping(nn.Module):
    """TII's feature map g(f) = LN(f + W2 GELU(W1 f)) (vit L321-369 with hidden [h]: W1 d -> h d, W2 h d -> d, dropout
    0, LayerNorm eps 1e-5); weights N(0, 0.02) truncated and biases 0 (timm's ViT init, which the code applies)."""

    def __init__(self, dim: int, hidden: int, device: torch.device) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim * hidden, device=device)
        self.fc2 = nn.Linear(dim * hidden, dim, device=device)
        self.norm = nn.LayerNorm(dim, device=device)
        for fc in (self.fc1, self.fc2):
            init_head(fc, "trunc_normal")

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.norm(f + self.fc2(F.gelu(self.fc1(f))))


def prefix_layout(prompts: torch.Tensor, layout: str) -> torch.Tensor:
    """Each image's (key, value) prefixes from its selected prompts (B, 2, L, D): as they are (``correct``), or the
    official reshape of the stacked (2, B, ...) to (B, 2, ...) without swapping axes (``official_reshape``)."""
    if layout == "correct":
        return prompts
    return prompts.transpose(0, 1).reshape(prompts.shape)


def proto_loss(feats: torch.Tensor, means: torch.Tensor, temperature: float) -> torch.Tensor:
    """L_proto: M = [means; feats], cross-entropy of each row of M M^T / temperature to its own column (engine
    L528-547: every stored centroid, then the batch)."""
    m = torch.cat([means.to(feats.dtype), feats]).float()
    sim = m @ m.T / temperature
    return F.cross_entropy(sim, torch.arange(len(m), device=m.device))


def grouped_proto_loss(feats: torch.Tensor, means: torch.Tensor, temperature: float, size: int) -> torch.Tensor:
    """The mean of :func:`proto_loss` over the batch cut into groups of ``size`` rows, each with every centroid: the
    code's per-GPU losses as DDP averages their gradients."""
    return torch.stack([proto_loss(part, means, temperature) for part in feats.split(size)]).mean()


def inferred_tasks(logits: torch.Tensor, tasks: list[Task]) -> torch.Tensor:
    """TII's task of each image (B,): the task owning the argmax class of logits over the seen classes (the code's
    ``target_task_map``; unseen classes have no logit, as its -inf mask)."""
    seen = [t for t in tasks if t.offset < logits.shape[1]]
    ends = torch.tensor([t.offset + t.num_classes for t in seen], device=logits.device)
    return torch.bucketize(logits.argmax(1), ends, right=True)


def mixture(current: torch.Tensor, earlier: torch.Tensor, m: float) -> torch.Tensor:
    """(1 - m) X_t + m mean(X_0..X_{t-1}): ``earlier`` stacked on dim 0, its mean without gradient."""
    return (1 - m) * current + m * earlier.detach().mean(0)


class HiDe(Method):
    Config = HiDeConfig
    changes_backbone = False
    batch_level_options = ("prefix_layout=official_reshape",)

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: HiDeConfig) -> None:
        super().__init__(backbone, benchmark, config)
        backbone.requires_grad_(False)
        width, device, slots = backbone.num_features, backbone.pos_embed.device, len(self.tasks)
        self.layers = within_depth("method.layers", config.layers, len(backbone.blocks))
        self.tii_mlp = MlpMapping(width, config.tii.hidden, device)
        self.tii_heads = nn.ModuleList()
        self.tii_aligner = GaussianAligner(config.tii_alignment, width)
        self.tap_aligner = GaussianAligner(config.tap_alignment, width)
        self.train_sizes = [len(split) for split in benchmark.train]
        self.stage = "train"
        if config.peft == "prompt":
            shape = (len(self.layers), 2, config.length, width)
            self.prompts = nn.ParameterList(
                nn.Parameter(prompt_init(config.prompt_init, *shape, device=device)) for _ in range(slots)
            )
            self.prefixed = wrap_prefix_layers(backbone, self.layers)
        else:
            r = config.lora_rank
            self.scale = lora.Magnitudes(slots, init=1 / r, trainable=False, device=device)
            self.lora = lora.attach(backbone, ("k", "v"), r, slots, self.scale, blocks=self.layers)
            with torch.no_grad():
                for wrapper in self.lora.wrappers:  # Kaiming-uniform (a = sqrt 5) on the code's (d, r): U(±1/sqrt r)
                    wrapper.a.uniform_(-1 / math.sqrt(r), 1 / math.sqrt(r))

    @classmethod
    def batch_level(cls, config: HiDeConfig) -> list[str]:
        """The official prefix reshape, where prompts are the slots (LoRA slots are chosen per image)."""
        return super().batch_level(config) if config.peft == "prompt" else []

    @staticmethod
    def unused_keys(config: HiDeConfig) -> dict[str, str]:
        other = {
            "prompt": ("lora_rank", "lora_momentum"),
            "lora": ("length", "prompt_momentum", "prefix_layout", "prompt_init"),
        }[config.peft]
        return {f"method.{key}": f"method.peft={config.peft}" for key in other}

    @classmethod
    def scores_unseen_classes(cls) -> bool:
        """The code's CIL head covers every class: the untrained ones can join the argmax (``cil_classes=all``)."""
        return True

    # ----------------------------------------------------------------------------- lifecycle
    def new_head(self, num_classes: int) -> nn.Linear:
        head = super().new_head(num_classes)
        init_head(head, self.config.head_init)
        return head

    @torch.no_grad()
    def before_task(self, task: Task) -> None:
        """The task's head and TII head, room for its statistics, and its slot as a copy of the previous one."""
        super().before_task(task)
        self.tii_heads.append(self.new_head(task.num_classes))
        self.tii_aligner.add_task(self.tii_heads[task.id])
        self.tap_aligner.add_task(self.heads[task.id])
        if task.id and self.config.peft == "prompt":
            self.prompts[task.id].copy_(self.prompts[task.id - 1])
        elif task.id:
            for wrapper in self.lora.wrappers:
                wrapper.a.copy_(wrapper.bank_a[task.id - 1])
                wrapper.b.copy_(wrapper.bank_b[task.id - 1])

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [
            Phase("tii_train", self.config.tii.epochs, trainer=self.tii_trainer()),
            Phase("tii_stats", 1, observe=True),
            *self.tii_aligner.phases(task, "tii_align"),
            Phase("train", epochs),
            Phase("tap_stats", 1, observe=True),
            *self.tap_aligner.phases(task, "tap_align"),
        ]

    def tii_trainer(self) -> dict[str, Any]:
        """TII's recipe over the run's: its optimizer (Adam) and lr as stored, no weight decay, clip 1."""
        c = self.config.tii
        return {
            "optimizer": c.optimizer, "lr": c.lr, "weight_decay": 0.0, "schedule": c.schedule, "lr_scale_batch": None,
            "grad_clip": c.grad_clip, "warmup_epochs": 0.0, "min_lr": 0.0, "milestones": list(c.milestones),
            "lr_decay": 0.1, "schedule_steps": "epoch",
        }  # fmt: skip

    def before_phase(self, task: Task, phase: Phase) -> None:
        self.stage = phase.name
        if phase.name == "tii_stats":
            self.tii_aligner.start(self.train_sizes[task.id])
        elif phase.name == "tap_stats":
            self.settle_slot(task)
            self.tap_aligner.start(self.train_sizes[task.id])
        elif phase.name == "tii_align":
            self.tii_aligner.settle()
        elif phase.name == "tap_align":
            self.tap_aligner.settle()

    def after_task(self, task: Task) -> None:
        self.tii_aligner.settle()  # the first task has no alignment phase to settle its statistics before
        self.tap_aligner.settle()
        self.stage = "train"

    @torch.no_grad()
    def settle_slot(self, task: Task) -> None:
        """The trained slot replaced by its momentum mixture with the earlier slots (t >= 1); a LoRA slot then moves
        into the bank."""
        t = task.id
        if self.config.peft == "prompt":
            if t and self.config.prompt_momentum:
                earlier = torch.stack(list(self.prompts[:t]))
                self.prompts[t].copy_(mixture(self.prompts[t], earlier, self.config.prompt_momentum))
            return
        for wrapper in self.lora.wrappers:
            if t and self.config.lora_momentum:
                wrapper.a.copy_(mixture(wrapper.a, wrapper.bank_a[:t], self.config.lora_momentum))
                wrapper.b.copy_(mixture(wrapper.b, wrapper.bank_b[:t], self.config.lora_momentum))
            wrapper.store(t, torch.ones_like(wrapper.bank_gain[t]))

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """TII: the MLP and the task's TII head (alignment: every TII head); WTP: the slot, and the task's head at
        ``head_lr_scale`` x the lr; TAP: every head."""
        self.requires_grad_(False)
        tii = [*self.tii_mlp.parameters(), *self.tii_heads[task.id].parameters()]
        if phase.name == "tii_train":
            return [{"params": self.trained(tii)}]
        if phase.name == "tii_align":
            params = self.trained([*self.tii_mlp.parameters(), *self.tii_heads.parameters()])
            return [{"params": params, "weight_decay": self.config.tii_alignment.weight_decay}]
        if phase.name == "tap_align":
            return self.tap_aligner.param_groups(self.heads)
        slot = [self.prompts[task.id]] if self.config.peft == "prompt" else self.lora.current()
        head = {"params": self.trained(list(self.heads[task.id].parameters())), "lr_factor": self.config.head_lr_scale}
        return [{"params": self.trained(slot)}, head]

    @staticmethod
    def trained(params: list[nn.Parameter]) -> list[nn.Parameter]:
        for p in params:
            p.requires_grad_(True)
        return params

    # ----------------------------------------------------------------------------- the two networks
    def original(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen, unprompted ViT's pre-logit feature f (no slot), without gradients."""
        if self.config.peft == "lora":
            self.lora.activate(False)
        try:
            with torch.no_grad():
                return self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)
        finally:
            if self.config.peft == "lora":
                self.lora.activate(True)

    def tii_logits(self, f: torch.Tensor) -> torch.Tensor:
        """TII's logits over the seen classes: every TII head on g(f)."""
        g = self.tii_mlp(f)
        return torch.cat([head(g) for head in self.tii_heads], dim=1)

    def slot_prompts(self, slots: torch.Tensor, training: Task | None) -> torch.Tensor:
        """Every image's prompts (layers, B, 2, L, D): its slot's, or while task t trains slot t's momentum mixture."""
        if training is not None:
            t, m = training.id, self.config.prompt_momentum
            prompt = self.prompts[t]
            if t and m:
                prompt = mixture(prompt, torch.stack(list(self.prompts[:t])), m)
            chosen = prompt[:, None].expand(-1, len(slots), -1, -1, -1)
        else:
            chosen = torch.stack(list(self.prompts), dim=1)[:, slots]
        return torch.stack([prefix_layout(layer, self.config.prefix_layout) for layer in chosen])

    def prompted(self, x: torch.Tensor, slots: torch.Tensor, training: Task | None = None) -> torch.Tensor:
        """The pre-logit feature of the ViT with each image's slot (``training``: the trained task's, mixed)."""
        if self.config.peft == "lora":
            bank = len(self.tasks)  # the current component's index: the slot being trained
            self.lora.choose(torch.full_like(slots, bank) if training is not None else slots)
        else:
            for attn, prompts in zip(self.prefixed.values(), self.slot_prompts(slots, training), strict=True):
                attn.prefix = prompts
        try:
            return self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)
        finally:
            if self.config.peft == "lora":
                self.lora.choose(None)
            else:
                for attn in self.prefixed.values():
                    attn.prefix = None

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """The prompted feature through task ``task_id``'s slot, or (None) the slot TII infers for each image."""
        slots = self.infer(x) if task_id is None else torch.full((len(x),), task_id, device=x.device)
        return self.prompted(x, slots)

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """TII's task of each image."""
        return inferred_tasks(self.tii_logits(self.original(x)), self.tasks)

    # ----------------------------------------------------------------------------- training
    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """TII: cross-entropy over the task's classes of the TII logits; WTP: the same of the prompted logits + reg x
        L_proto; the alignments: the aligner's loss on drawn features ``x``."""
        ce = PromptMethod.current_task_ce
        sizes = [t.num_classes for t in self.tasks[: task.id + 1]]
        if self.stage == "tii_train":
            return ce(self.tii_logits(self.original(x)), y, task), {}
        if self.stage in ("tii_align", "tap_align"):
            with torch.autocast(x.device.type, enabled=False):
                logits = self.tii_logits(x.float()) if self.stage == "tii_align" else self.seen_logits(x.float())
                return (self.tii_aligner if self.stage == "tii_align" else self.tap_aligner).loss(logits, y, sizes), {}
        feats = self.prompted(x, torch.full((len(x),), task.id, device=x.device), training=task)
        # groups of the whole batch's size / proto_groups rows: a rank cuts its share into them, which is one process's
        # grouping where the share is a whole number of groups (192 over 2, 4 or 8 ranks)
        size = -(-(self.batch_share[0] if self.batch_share else len(feats)) // self.config.proto_groups)
        proto = grouped_proto_loss(feats, self.tap_aligner.means(task.id), self.config.proto_temperature, size)
        return ce(self.seen_logits(feats), y, task) + self.config.reg * proto, {"proto": proto.detach()}

    def drawn_split(self, task: Task, phase: Phase, epoch: int) -> Split:
        aligner = self.tii_aligner if phase.name == "tii_align" else self.tap_aligner
        return aligner.draw(self.tasks, task.id, epoch)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """TII: the frozen ViT's features; TAP: the prompted ones through the task's own slot (fp32)."""
        with torch.autocast(x.device.type, enabled=False):
            x = x.float()
            if self.stage == "tii_stats":
                self.tii_aligner.observe(self.original(x), y - task.offset, rows)
            else:
                self.tap_aligner.observe(self.features(x, task.id), y - task.offset, rows)

    def observations(self) -> list[torch.Tensor]:
        return self.tii_aligner.observations() if self.stage == "tii_stats" else self.tap_aligner.observations()

    # ----------------------------------------------------------------------------- inference
    @torch.no_grad()
    def predict(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """TIL: the task's slot and head; CIL: TII's slot for each image, then every seen head."""
        if task_id is not None:
            return self.task_logits(x, task_id)
        return self.seen_logits(self.features(x, None))

    @torch.no_grad()
    def predict_scenarios(
        self, x: torch.Tensor, task_id: int, scenarios: tuple[str, ...], cil_classes: str = "seen"
    ) -> dict[str, torch.Tensor]:
        out = {}
        if "til" in scenarios:
            out["til"] = self.predict(x, task_id)
        if "cil" in scenarios:
            feats = self.features(x, None)
            cil = self.seen_logits(feats)
            if cil_classes == "all":
                cil = torch.cat([cil, self.untrained_logits(feats).to(cil.dtype)], dim=1)
            out["cil"] = cil
        return out

    # ----------------------------------------------------------------------------- bookkeeping
    def forwards_per_test_image(self) -> dict[str, int]:
        """TIL: the prompted pass with the given slot; CIL: the frozen pass for TII, then the prompted one."""
        return {"til": 1, "cil": 2}

    def slot_numel(self) -> int:
        if self.config.peft == "prompt":
            return self.prompts[0].numel()
        return self.lora.numel_per_component()

    def storage(self) -> dict[str, Any]:
        """Per task: its head and TII head, its slot, both statistics (32-bit); shared: the TII MLP."""
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            entry["tii_head"] = 32 * sum(p.numel() for p in self.tii_heads[t].parameters())
            entry[f"{self.config.peft}_slot"] = 32 * self.slot_numel()
            entry.update({f"tii_{k}": v for k, v in self.tii_aligner.storage_bits(t).items()})
            entry.update({f"tap_{k}": v for k, v in self.tap_aligner.storage_bits(t).items()})
        out["shared_bits"] = {"tii_mlp": 32 * sum(p.numel() for p in self.tii_mlp.parameters())}
        return out

    def extra_results(self) -> dict[str, Any]:
        c = self.config
        return {"hide": {"peft": c.peft, "prefix_layout": c.prefix_layout, "ca_steps": c.ca_steps}}

    def slot_state(self) -> dict[str, torch.Tensor]:
        if self.config.peft == "prompt":
            return {f"prompt.{t}": p.detach().clone() for t, p in enumerate(self.prompts)}
        return self.lora.state("lora.")

    def artifacts(self) -> dict[str, torch.Tensor]:
        tii = {f"tii_mlp.{k}": v for k, v in self.tii_mlp.state_dict().items()}
        tii |= {f"tii_head.{t}.{k}": v for t, h in enumerate(self.tii_heads) for k, v in h.state_dict().items()}
        return super().artifacts() | {k: v.detach().clone() for k, v in tii.items()} | self.slot_state()

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.tii_mlp.load_state_dict({k.removeprefix("tii_mlp."): v for k, v in tensors.items() if "tii_mlp." in k})
        for t in range(self.num_seen):
            head = self.new_head(self.heads[t].out_features)
            head.load_state_dict({k.removeprefix(f"tii_head.{t}."): v for k, v in tensors.items()
                                  if k.startswith(f"tii_head.{t}.")})  # fmt: skip
            self.tii_heads.append(head)
        if self.config.peft == "prompt":
            for t, p in enumerate(self.prompts):
                p.copy_(tensors[f"prompt.{t}"])
        else:
            self.lora.load(tensors, "lora.")
