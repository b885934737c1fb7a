"""The method contract: what the one training loop calls, in order, for every task.

For each task the loop calls ``before_task`` -> for each of ``phases``: ``before_phase``, an optimizer over
``param_groups``, for each epoch ``before_epoch`` and steps of ``before_step`` / ``training_loss`` / backward /
``after_backward`` / optimizer step / ``after_step`` -> ``after_task``; then it evaluates with ``predict``. A method
owns its parameters, heads and masks; the loop owns devices, precision, optimizers, schedules, evaluation and
logging.

Heads: one Linear per task (``heads[t]`` over task ``t``'s classes). Concatenated they form the growing
class-incremental head, so a task-incremental prediction is the task's own head and a class-incremental
one is the argmax over all seen classes.

Evaluation rules every method keeps (tests/test_honest_evaluation.py checks them for every registered method):
an image's logits do not depend on the other images of its batch, nor on the images predicted before it (unless the
run turns on one of the method's :attr:`Method.batch_level_options`, which results.json then names); and no
class-incremental logit depends on the task id, whether handed to ``predict_scenarios`` for TIL, set by
``evaluating``, or found another way (a reference to the test data and its labels, the order of the calls).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import STEP_SAMPLERS, RunConfig
from clbench.data import Benchmark, Split, Task
from clbench.memory import Memory
from clbench.methods.parts.bottleneck import Bottleneck

Logs = dict[str, torch.Tensor]


class Replay(NamedTuple):
    """One batch drawn from the rehearsal memory for a training step: this rank's rows, augmented like the current
    batch, with their global labels and, where the memory keeps them (DER++), the stored logits (padded to every
    class) and how many classes each row's logits cover."""

    x: torch.Tensor
    y: torch.Tensor
    logits: torch.Tensor | None = None
    width: torch.Tensor | None = None


HEAD_INITS = ("default", "trunc_normal", "bert", "zeros")


def init_head(head: nn.Linear, kind: str) -> None:
    """A head's first weights: ``default`` keeps nn.Linear's (U(+-1/sqrt(D)) weight and bias: CODA-Prompt's code),
    ``trunc_normal`` N(0, 0.02) truncated at +-2 and a zero bias (timm's ViT init in the PyTorch ports of L2P and
    DualPrompt), ``bert`` N(0, 0.02) truncated at two standard deviations and a zero bias (TensorFlow's
    ``truncated_normal_initializer(stddev=0.02)`` of BERT's classifier: adapter-bert run_classifier.py L546-552),
    ``zeros`` weight and bias (the L2P JAX code's ``kernel_init=zeros``)."""
    if kind == "default":
        return
    with torch.no_grad():
        if kind == "trunc_normal":
            nn.init.trunc_normal_(head.weight, std=0.02)
        elif kind == "bert":
            nn.init.trunc_normal_(head.weight, std=0.02, a=-0.04, b=0.04)
        else:
            head.weight.zero_()
        head.bias.zero_()


@dataclass(frozen=True)
class Phase:
    """A stretch of training with its own optimizer and schedule (e.g. PackNet's train, then retrain). An
    ``observe`` phase has no optimizer: one pass over the task's training data hands every batch to
    :meth:`Method.observe` (SimpleCIL's prototypes), through the test transform, or with ``augment`` through the
    training one (statistics a method's code gathers from augmented images). A ``memory`` phase updates the
    rehearsal memory from the task's training data with its sampler (balanced, herding, greedy). ``data``: what a
    training phase trains on: ``task`` (the task's data, or what :meth:`Method.train_task_ids` names), ``memory``
    (the memory alone: GDumb's fit), ``task+memory`` (both, shuffled together: BiC), ``validation`` (the memory's
    held-out images: BiC's bias stage) or ``features`` (no image: features the method draws for each epoch,
    :meth:`Method.drawn_split`, which its ``training_loss`` receives in place of images: SLCA's classifier
    alignment). The images a memory holds out for validation are left out of the first three. ``trainer``: the
    phase's own optimisation settings over the run's (``trainer.*`` keys: its optimizer, lr, batch size, schedule),
    e.g. a head-only stage with its own recipe."""

    name: str
    epochs: int
    observe: bool = False
    memory: bool = False
    data: str = "task"
    augment: bool = False
    trainer: Mapping[str, Any] | None = None


class Method(nn.Module):
    """Base class: a timm ViT backbone plus per-task linear heads.

    Subclasses set ``Config`` (a dataclass of their hyperparameters, validated before training) and
    implement ``param_groups`` and ``training_loss``. ``task_conditioned`` methods need the task id to
    select their per-task state; without it (class-incremental evaluation) they infer the task.
    """

    Config: ClassVar[type]
    task_conditioned: ClassVar[bool] = False
    changes_backbone: ClassVar[bool] = True  # its backbone weights are saved with the run (artifacts)
    soft_targets: ClassVar[bool] = False  # its loss is cross-entropy over the task's classes (:meth:`task_loss`)
    # Its training step can be replayed as one CUDA graph: every value that changes from step to step is a device
    # tensor written in place (HAT's s) or drawn on the device (MEAT's Gumbel noise), never a Python number or a
    # host-side draw read inside ``training_loss``/``after_backward``/``after_step``.
    graph_safe: ClassVar[bool] = True
    # Rebuilt from the paper's principle where its equations and code could not be read (results.json says so).
    reconstructed: ClassVar[bool] = False
    # Rehearsal: the sampler of the method's paper (memory.sampler=auto), None for a method that cannot use a memory;
    # whether it needs one; how many independent memory batches each training step draws (handed to
    # ``training_loss`` as ``replay``); whether the memory keeps each image's logits (DER++).
    memory_sampler: ClassVar[str | None] = None
    needs_memory: ClassVar[bool] = False
    replay_draws: ClassVar[int] = 0
    memory_logits: ClassVar[bool] = False
    memory_holdout: ClassVar[float] = 0.0  # the share of each class's memory held out for validation (BiC: 0.1)
    # Keys of ``Config`` that make one test image's prediction depend on the rest of its batch (an official code's
    # batch-level rule, such as L2P's prompt vote): a boolean key (on when true) or ``key=value`` (a choice, on when the
    # key holds that value: HiDe's prefix layout); off by default, named in results.json when a run sets one.
    batch_level_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: Any) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = config
        self.tasks = benchmark.tasks
        self.heads = nn.ModuleList()
        self.batch_share = None
        self.memory: Memory | None = None  # set by the loop when the run has a memory budget
        # DER++: the logits of the step's current rows, which the loop stores with them after the step.
        self.stored_logits: torch.Tensor | None = None
        self.untrained_heads: dict[int, nn.Linear] = {}  # :meth:`untrained_logits`' heads (not trained, not saved)

    @property
    def batch_share(self) -> tuple[int, slice] | None:
        """(size of the whole batch, this rank's part of it), set by the loop before each training step: random
        draws per sample (MEAT's token masks, an adapter's dropout) are made for the whole batch, so every rank of a
        multi-process run consumes random numbers as one process does and takes its own rows."""
        return self._batch_share

    @batch_share.setter
    def batch_share(self, share: tuple[int, slice] | None) -> None:
        """Also hands ``share`` to every dropout bottleneck of the method and its backbone."""
        self._batch_share = share
        for module in self.modules():
            if isinstance(module, Bottleneck) and module.dropout:
                module.share = share

    @classmethod
    def check_run(cls, cfg: RunConfig) -> None:
        """Refuse (:class:`clbench.errors.ConfigError`), before any work, a setting of the whole run that this method
        cannot train with or that would record numbers it did not earn; ``cfg`` is the validated config."""

    @classmethod
    def graph_blocker(cls, config: Any) -> str | None:
        """Why this method's step under ``config`` cannot be replayed as one CUDA graph; None where it can."""
        return None if cls.graph_safe else "the method draws per-step values on the host"

    @classmethod
    def batch_level(cls, config: Any) -> list[str]:
        """The :attr:`batch_level_options` that ``config`` turns on, as ``method.<key>``: with any, a prediction depends
        on the other images of its batch (results.json's ``evaluation.batch_level``; the run warns)."""
        on = []
        for option in cls.batch_level_options:
            key, _, value = option.partition("=")
            if (str(getattr(config, key)) == value) if value else getattr(config, key):
                on.append(f"method.{key}")
        return on

    @staticmethod
    def unused_keys(config: Any) -> dict[str, str]:
        """Hyperparameters that ``config`` makes inert, ``{"method.key": "the setting that makes it so"}``: a run that
        sets one is warned at its start (a sweep over it would give equal results)."""
        return {}

    @staticmethod
    def check_trainer(config: Any, trainer: Any) -> None:
        """Refuse, before any work, a setting of the method that cannot train under ``trainer`` (its
        :class:`~clbench.config.TrainerConfig`): raise :class:`~clbench.errors.ConfigError` naming the keys."""

    # ----------------------------------------------------------------------------- lifecycle hooks
    @property
    def num_seen(self) -> int:
        """Tasks whose heads exist: all tasks up to the one being trained."""
        return len(self.heads)

    def before_task(self, task: Task) -> None:
        """Add the task's head; subclasses extend this to create per-task state."""
        if task.id != self.num_seen:
            raise RuntimeError(f"tasks must come in order: expected task {self.num_seen}, got {task.id}")
        self.add_head(task.num_classes)

    def new_head(self, num_classes: int) -> nn.Linear:
        """A freshly initialised head over ``num_classes`` classes (not yet added)."""
        return nn.Linear(self.backbone.num_features, num_classes, device=self.backbone.cls_token.device)

    def add_head(self, num_classes: int) -> nn.Linear:
        head = self.new_head(num_classes)
        self.heads.append(head)
        return head

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        """Train; then, with a memory whose sampler works after a task, update the memory."""
        return [Phase("train", epochs), *self.memory_phase()]

    def draws_replay(self, task: Task) -> bool:
        """Whether the training steps of ``task`` draw from the memory (once it holds something)."""
        return bool(self.replay_draws)

    def memory_phase(self) -> list[Phase]:
        """The ``memory`` phase of a memory filled after each task (none for the reservoir or without a memory)."""
        if self.memory is None or self.memory.sampler in STEP_SAMPLERS:
            return []
        return [Phase("memory", 0, memory=True)]

    def before_phase(self, task: Task, phase: Phase) -> None:
        """Called before each phase's optimizer is built (state-machine transitions live here)."""

    def train_task_ids(self, task: Task) -> list[int]:
        """The tasks whose training data is used while training ``task`` (Joint: all seen)."""
        return [task.id]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """Optimizer groups; a group may carry its own ``lr`` (or ``lr_factor``, a factor on ``trainer.lr``) and
        ``weight_decay`` (then applied to every parameter of the group, biases and norms included)."""
        raise NotImplementedError

    def check_steps(self, task: Task, phase: Phase, optimizer: torch.optim.Optimizer) -> None:
        """Refuse a training phase whose steps cannot train, before the first one (raise
        :class:`~clbench.errors.ConfigError`): what only the method's state after earlier tasks decides (EWC's
        stability bound on its Fisher)."""

    def before_epoch(self, task: Task, samples: int, batch_size: int) -> None:
        """Called before each epoch (also one resumed part-way) with its number of training samples and the batch
        size (HAT's official annealing counts samples, not batches)."""

    def before_step(self, task: Task, batch: int, num_batches: int) -> None:
        """Called before each training step with the batch's index within its epoch (HAT's annealing). It runs
        outside a captured step: what it sets must be written in place into device tensors the step reads."""

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """Loss on a batch of ``task`` (``y`` holds global labels) and device-side scalars to log: to W&B every
        ``trainer.log_every`` steps, and as means over each phase to results.json's ``method_diagnostics`` and the
        run's summary."""
        raise NotImplementedError

    def takes_soft_targets(self) -> bool:
        """Whether ``training_loss`` accepts mixup/cutmix targets: soft labels over the task's classes."""
        return self.soft_targets

    @staticmethod
    def task_loss(logits: torch.Tensor, y: torch.Tensor, task: Task) -> torch.Tensor:
        """Cross-entropy of logits over ``task``'s classes against global labels ``y``, or (mixup/cutmix) against
        soft targets over the task's classes."""
        return F.cross_entropy(logits, y if y.is_floating_point() else y - task.offset)

    def after_backward(self, task: Task) -> None:
        """Gradient surgery before the optimizer step (HAT, PackNet)."""

    def after_step(self, task: Task) -> None:
        """Re-impose constraints after the optimizer step (masks, clamps)."""

    def after_task(self, task: Task) -> None:
        """Consolidate the task: prune, freeze, binarise masks."""

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """Take in a batch of an ``observe`` phase (no gradients; ``y`` holds global labels; ``rows``: the batch's
        positions in the phase's data, the ids :meth:`takes_ids` methods get in training)."""
        raise NotImplementedError

    def takes_ids(self) -> bool:
        """Whether ``training_loss`` takes ``ids``: the positions of the batch's rows in the phase's data (LwF's and
        BiC's teacher logits recorded once in an observe phase, looked up by position)."""
        return False

    def observations(self) -> list[torch.Tensor]:
        """The sums an ``observe`` phase accumulated; the loop adds them up over the ranks of a multi-process run."""
        return []

    def drawn_split(self, task: Task, phase: Phase, epoch: int) -> Split:
        """What a ``features`` phase trains on in ``epoch``: float features (N x D) and their global labels, drawn on
        the device by the method (SLCA: samples of its class Gaussians). The same (run seed, task, epoch) must give the
        same draw, so that an epoch resumed from a checkpoint trains on the features it was interrupted on; every rank
        draws the whole set and trains on its share of each batch."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- inference
    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """Pre-logit features (final-norm CLS token); ``task_id`` selects per-task state where there is any."""
        return self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)

    def head_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        """Task ``task_id``'s head on features: logits over its classes."""
        return self.heads[task_id](feats)

    def seen_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Logits over all seen classes: the concatenated per-task heads."""
        return torch.cat([self.head_logits(feats, t) for t in range(self.num_seen)], dim=1)

    def task_logits(self, x: torch.Tensor, task_id: int) -> torch.Tensor:
        return self.head_logits(self.features(x, task_id), task_id)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """Task-incremental logits over ``task_id``'s classes, or (``None``) logits over all seen classes."""
        if task_id is not None:
            return self.task_logits(x, task_id)
        if self.task_conditioned:
            return self.lowest_entropy_task(self.every_task_logits(x))
        return self.seen_logits(self.features(x, None))

    @torch.no_grad()
    def predict_scenarios(
        self, x: torch.Tensor, task_id: int, scenarios: tuple[str, ...], cil_classes: str = "seen"
    ) -> dict[str, torch.Tensor]:
        """``predict(x, task_id)`` as "til" and ``predict(x, None)`` as "cil", for the ``scenarios`` asked, sharing
        the work they have in common: a task-agnostic method runs its forward once for both; a task-conditioned
        one takes the TIL logits from the path of ``task_id`` that its CIL task inference runs anyway. A method
        with its own CIL inference (an overridden ``predict``: SupSup) predicts each scenario separately.
        ``task_id``, the evaluated task, is TIL's: the CIL logits never depend on it (nor on the other rows of ``x``).
        ``cil_classes="all"`` (:meth:`scores_unseen_classes` methods): the CIL logits also cover the classes of the
        tasks not trained yet (:meth:`untrained_logits`)."""
        if cil_classes == "all" and not self.scores_unseen_classes():
            raise ValueError(f"{type(self).__name__} has no logits for classes it has not trained")
        if "cil" not in scenarios or type(self).predict is not Method.predict:
            return {s: self.predict(x, task_id if s == "til" else None) for s in scenarios}
        if self.task_conditioned:
            per_task = self.every_task_logits(x)
            both = {"til": per_task[task_id], "cil": self.lowest_entropy_task(per_task)}
        else:
            feats = self.features(x, None)
            cil = self.seen_logits(feats)
            if cil_classes == "all":
                cil = torch.cat([cil, self.untrained_logits(feats).to(cil.dtype)], dim=1)
            both = {"til": self.head_logits(feats, task_id), "cil": cil}
        return {s: both[s] for s in scenarios}

    @classmethod
    def scores_unseen_classes(cls) -> bool:
        """Whether CIL can take the argmax over every class of the benchmark, the untrained ones included: one head
        over all classes read without task inference (not a task-conditioned method, nor one with its own CIL)."""
        return not cls.task_conditioned and cls.predict is Method.predict

    def untrained_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Logits of the classes of the tasks not trained yet, (B, 0) once every task is: the scores a single head
        over all classes gives them before their task (the official L2P and DualPrompt codes' CIL). Each such task's
        head is drawn once, as :meth:`new_head` draws it, from its own seed (the run's and the task's), so every
        evaluation reads the same untrained heads and the run's random stream is untouched; it is not the head the
        task later trains from (the same distribution, another draw)."""
        cache = self.untrained_heads
        logits = [feats.new_zeros(len(feats), 0)]
        for task in self.tasks[self.num_seen :]:
            if task.id not in cache:
                devices = [feats.device] if feats.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(hash((torch.initial_seed(), task.id)) % 2**63)
                    cache[task.id] = self.new_head(task.num_classes)
            logits.append(cache[task.id](feats))
        return torch.cat(logits, dim=1)

    @contextmanager
    def evaluating(self, task_id: int) -> Iterator[None]:
        """Wraps the evaluation of ``task_id``'s test data, for per-task diagnostics (L2P's prompt histogram).
        A prediction must never depend on it."""
        yield

    def every_task_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each seen task's path: its TIL logits."""
        return [self.task_logits(x, t) for t in range(self.num_seen)]

    @staticmethod
    def lowest_entropy_task(per_task: list[torch.Tensor]) -> torch.Tensor:
        """Class-incremental prediction for task-conditioned methods from every seen task's logits: keep, per
        sample, the task whose softmax has the lowest entropy. Returns logits over all seen classes that are
        ``-inf`` outside the chosen task, so their argmax is the prediction."""
        per_task = [logits.float() for logits in per_task]
        entropy = torch.stack([torch.special.entr(F.softmax(lg, dim=1)).sum(1) for lg in per_task])
        chosen = entropy.argmin(0)  # (B,)
        out = torch.cat(per_task, dim=1)
        owner = torch.cat([torch.full((lg.shape[1],), t, device=lg.device) for t, lg in enumerate(per_task)])
        return out.masked_fill(owner[None, :] != chosen[:, None], float("-inf"))

    # ----------------------------------------------------------------------------- bookkeeping
    def forwards_per_test_image(self) -> dict[str, int]:
        """Backbone forward passes one test image costs after the tasks seen so far, predicted alone in each scenario
        (results.json's ``test_time_cost``): TIL reads the given task's path, one pass; CIL one pass over the
        concatenated heads, or, for a task-conditioned method's lowest-entropy task inference, one pass per seen
        task. A method whose :meth:`predict` costs otherwise overrides it."""
        return {"til": 1, "cil": self.num_seen if self.task_conditioned else 1}

    def storage(self) -> dict[str, Any]:
        """What the method keeps per task, in bits, by component; and its trainable parameter count."""
        return {
            "bits_per_task": [{"head": 32 * sum(p.numel() for p in head.parameters())} for head in self.heads],
            "trainable_params": sum(p.numel() for p in self.parameters() if p.requires_grad),
        }

    def artifacts(self) -> dict[str, torch.Tensor]:
        """Tensors saved with the run after every task (method_artifacts.safetensors): what evaluating the
        finished tasks again needs besides the config: the heads, the backbone if the method changes it,
        and the method's per-task state (masks, owner indices). :meth:`load_artifacts` is the inverse."""
        out = {f"head.{t}.{k}": v for t, h in enumerate(self.heads) for k, v in h.state_dict().items()}
        if self.changes_backbone:
            out |= {f"backbone.{k}": v for k, v in self.backbone.state_dict().items()}
        return {k: v.detach().clone() for k, v in out.items()}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the finished tasks of a run into this freshly built method (same config and seed)."""
        if self.num_seen:
            raise RuntimeError("load_artifacts expects a method that has not seen any task")
        num_heads = len({k.split(".")[1] for k in tensors if k.startswith("head.")})
        for t in range(num_heads):
            self.restore_head(
                {k.removeprefix(f"head.{t}."): v for k, v in tensors.items() if k.startswith(f"head.{t}.")}
            )
        if self.changes_backbone:
            saved = {k.removeprefix("backbone."): v for k, v in tensors.items() if k.startswith("backbone.")}
            self.backbone.load_state_dict(saved)

    def restore_head(self, saved: dict[str, torch.Tensor]) -> None:
        """Add the next task's head from its saved tensors (``head.<t>.*`` of :meth:`artifacts`)."""
        self.add_head(saved["weight"].shape[0]).load_state_dict(saved)

    def extra_results(self) -> dict[str, Any]:
        """Method-specific entries for results.json (e.g. L2P's prompt histogram)."""
        return {}

    def no_weight_decay_ids(self) -> set[int]:
        """Parameters exempt from weight decay (timm's convention): biases, norms, position/class tokens."""
        skip = {f"backbone.{name}" for name in self.backbone.no_weight_decay()}
        return {id(p) for name, p in self.named_parameters() if p.ndim <= 1 or name in skip}
