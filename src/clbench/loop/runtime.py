"""What the loop needs besides the method: the device, precision, data, transforms, ranks, and how the step is run
(compiled, replayed as a CUDA graph); built once per run by :func:`build_runtime`."""

from __future__ import annotations

import functools
import random
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from hydra.utils import get_class
from timm.data import Mixup

from clbench import distributed, smoke
from clbench.backbones import build_backbone, input_stats
from clbench.comparable import method_name
from clbench.config import RunConfig, config_dir, host_drawn_augmentation, memory_sampler
from clbench.data import Benchmark, DeviceTransform, Split, Task, build_benchmark
from clbench.data.benchmark import free_memory
from clbench.data.stream import DiskImages
from clbench.distributed import Ranks
from clbench.errors import ConfigError
from clbench.evaluation import SCENARIOS, Evaluation, evaluate
from clbench.loop.optim import schedulers_fill_tensor_rates
from clbench.loop.trained_parts import backbone_parts
from clbench.memory import Memory
from clbench.memory_budget import Budget, check_replay
from clbench.methods import Method
from clbench.tracking import say


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "Invalid value for `trainer.device`: 'cuda', but no CUDA device is visible. Allowed: auto, cpu."
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def uses_bf16(device: torch.device, precision: str) -> bool:
    """bf16 autocast on CUDA by default; fp32 on CPU unless bf16 is asked for."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast_for(device: torch.device, precision: str, *, cache: bool = True) -> AbstractContextManager:
    """The autocast of :func:`uses_bf16`. ``cache=False`` for a step captured as a CUDA graph (autocast's cache of
    cast weights must not outlive the capture)."""
    if not uses_bf16(device, precision):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)


@dataclass(frozen=True)
class Acceleration:
    """How the training step runs: ``compile`` (torch.compile of the method's forward and loss) and ``graphs`` (the
    whole step replayed as a CUDA graph), each with the reason it is off when it is."""

    compile: bool
    graphs: bool
    why_not_graphs: str | None = None

    def describe(self) -> str:
        graphs = "on" if self.graphs else f"off ({self.why_not_graphs})"
        return f"torch.compile {'on' if self.compile else 'off'}, CUDA graphs {graphs}"


def acceleration(cfg: RunConfig, device: torch.device, ranks: Ranks) -> Acceleration:
    """Resolve ``trainer.compile`` and ``trainer.cuda_graphs`` (auto: on where they pay and apply); ``true`` where it
    cannot apply is refused before any work."""
    trainer = cfg.trainer
    compiled = device.type == "cuda" if trainer.compile == "auto" else bool(trainer.compile)
    if trainer.cuda_graphs is False:
        return Acceleration(compiled, graphs=False, why_not_graphs="trainer.cuda_graphs=false")
    blocker = graph_blocker(cfg, device, ranks)
    if trainer.cuda_graphs is True and blocker is not None:
        raise ConfigError(f"Invalid value for `trainer.cuda_graphs`: true. Allowed: auto or false here: {blocker}.")
    return Acceleration(compiled, graphs=blocker is None, why_not_graphs=blocker)


def graph_blocker(cfg: RunConfig, device: torch.device, ranks: Ranks) -> str | None:
    """Why the training step cannot be replayed as one CUDA graph in this run; None where it can."""
    if device.type != "cuda":
        return "the device is not CUDA"
    if ranks.size > 1:
        return "a multi-process (DDP) run"
    why = get_class(cfg.method_target).graph_blocker(cfg.method)
    if why is not None:
        return why
    if not schedulers_fill_tensor_rates():
        return f"torch {torch.__version__}'s schedulers replace a tensor learning rate instead of filling it"
    return host_drawn_augmentation(cfg.trainer, cfg.data)


@dataclass
class AccelerationLog:
    """What compiling did in a run: graphs compiled, the seconds of the steps that compiled them, and the failure that
    made it fall back to eager (results.json's ``acceleration``, the summary)."""

    compiled_graphs: int = 0
    compile_s: float = 0.0
    compile_failure: str | None = None


@dataclass
class Runtime:
    """What the loop needs besides the method: data, transforms, device, precision, the process's rank and how the
    step runs."""

    cfg: RunConfig
    benchmark: Benchmark
    device: torch.device
    train_tf: DeviceTransform
    test_tf: DeviceTransform
    ranks: Ranks
    accel: Acceleration = Acceleration(compile=False, graphs=False, why_not_graphs="not asked for")
    log: AccelerationLog = field(default_factory=AccelerationLog)
    backbone_parts: dict[str, str] = field(default_factory=dict)  # the ViT's parameter names as built -> their part

    def mixup(self, task: Task) -> Mixup | None:
        """timm's Mixup/CutMix over the task's classes (DeiT's recipe), or None when both are off."""
        cfg = self.cfg.trainer
        if not (cfg.mixup or cfg.cutmix):
            return None
        return Mixup(
            mixup_alpha=cfg.mixup,
            cutmix_alpha=cfg.cutmix,
            label_smoothing=cfg.label_smoothing,
            num_classes=task.num_classes,
        )

    @functools.cached_property
    def streamed(self) -> bool:
        """Whether the training images are read from the on-disk cache (a rank then holds only its rows of a batch)."""
        return any(isinstance(split.x, DiskImages) for split in self.benchmark.train)

    @property
    def streamed_from(self) -> list[Split] | None:
        """The training splits where they are streamed from disk (None where they are held)."""
        return self.benchmark.train if self.streamed else None

    @property
    def autocast(self) -> AbstractContextManager:
        return autocast_for(self.device, self.cfg.trainer.precision, cache=not self.accel.graphs)

    def evaluate(
        self, method: Method, task_ids: list[int], scenarios: tuple[str, ...] = SCENARIOS, split: str = "test"
    ) -> Evaluation:
        return evaluate(
            method,
            self.benchmark,
            task_ids,
            transform=self.test_tf,
            batch_size=self.cfg.trainer.eval_batch_size,
            autocast=self.autocast,
            scenarios=scenarios,
            ranks=self.ranks,
            split=split,
            cil_classes=self.cfg.trainer.cil_classes,
        )


def build_runtime(cfg: RunConfig) -> tuple[Method, Runtime]:
    """Resolve the device and how the step runs, seed, then build the benchmark (on the device), the backbone, the
    method and the transforms."""
    device = resolve_device(cfg.trainer.device)
    ranks = distributed.current()
    accel = acceleration(cfg, device, ranks)
    seed_everything(cfg.seed)
    benchmark = build_benchmark(cfg.data, device, say, ranks)
    if cfg.smoke:  # a few images of each class: the run end to end in a minute, never a result
        benchmark = smoke.sampled(benchmark)
    backbone = build_backbone(cfg.backbone)
    mean, std = input_stats(backbone, cfg.backbone)
    parts = backbone_parts(backbone)  # before the method wraps any layer
    method = get_class(cfg.method_target)(backbone, benchmark, cfg.method).to(device)
    if (cfg.trainer.mixup or cfg.trainer.cutmix) and not method.takes_soft_targets():
        raise ConfigError(
            f"Invalid value for `trainer.mixup`/`trainer.cutmix`: {cfg.trainer.mixup}/{cfg.trainer.cutmix} with "
            f"{type(method).__name__}, whose loss is not cross-entropy over the task's classes. Allowed: 0 (off), or a "
            "method that takes mixed targets: meat, packnet, piggyback, supsup, hat, finetune with loss_scope=task."
        )
    size = cfg.backbone.img_size
    transforms = (DeviceTransform(cfg.data, size, mean, std, train=t, device=device) for t in (True, False))
    rt = Runtime(cfg, benchmark, device, *transforms, ranks=ranks, accel=accel, backbone_parts=parts)
    if cfg.memory.active:  # in pinned host memory where the training images stay on disk
        augmented = cfg.memory.view == "augmented"  # the model's input, as the step that stored it trained on it
        image_shape = (3, size, size) if augmented else tuple(benchmark.train[0].x.shape[1:])
        check_memory_budget(cfg, method, benchmark, device, host=rt.streamed, image_shape=image_shape)
        method.memory = Memory(
            cfg.memory,
            memory_sampler(cfg.memory, type(method)),
            num_classes=benchmark.num_classes,
            image_shape=image_shape,
            logits=method.memory_logits,
            holdout=method.memory_holdout,
            device=device,
            host=rt.streamed,
            batch_size=cfg.trainer.batch_size,
            longest_task=max(len(split) for split in benchmark.train),
        )
    return method, rt


def check_memory_budget(
    cfg: RunConfig,
    method: Method,
    benchmark: Benchmark,
    device: torch.device,
    *,
    host: bool,
    image_shape: tuple[int, ...],
) -> None:
    """Before the memory is allocated: its budget on this benchmark's class counts, its bytes where it will be held
    (``host``: pinned host memory; ``image_shape``: an image as the memory keeps it), and a step's replayed images on
    the device (:mod:`clbench.memory_budget`)."""
    sizes = [torch.bincount(split.y - t.offset, minlength=t.num_classes).tolist() for t, split in
             zip(benchmark.tasks, benchmark.train, strict=True)]  # fmt: skip
    budget = Budget(cfg.memory, sizes, type(method).__name__, method.memory_holdout)
    budget.check_quotas(memory_sampler(cfg.memory, type(method)))
    on_host = host or device.type == "cpu"
    free = free_memory(torch.device("cpu") if on_host else device)
    taken = budget.check_allocation(
        image_shape, logits=method.memory_logits, free=free, where="the host" if on_host else str(device)
    )
    if method.replay_draws:  # the replayed images are on the device, with the memory unless it is pinned on the host
        left = free - taken if device.type == "cpu" or not host else free_memory(device)
        check_replay(
            replay_rows(cfg),
            draws=method.replay_draws,
            image_shape=image_shape,
            img_size=cfg.backbone.img_size,
            free=left,
            where=str(device),
        )


def describe(cfg: RunConfig, method: Method, rt: Runtime, weights: Path | None) -> list[str]:
    """Two lines for the start of a run: the backbone and its weights (and, for the embedded micro ViT, how to get a
    paper's backbone), and where and how the step runs."""
    params = sum(p.numel() for p in method.backbone.parameters()) / 1e6
    backbone = cfg.backbone
    source = (
        f"weights {weights}"
        if weights is not None
        else f"weights {backbone.model}.{backbone.tag} from the Hugging Face hub"
        if backbone.pretrained
        else "random initialisation (backbone.pretrained=false)"
    )
    mean, std = input_stats(method.backbone, backbone)
    pixels = f"input normalised with mean {mean}, std {std}" if backbone.normalize else "input pixels in [0, 1]"
    first = f"backbone: {backbone.name}, {params:.1f}M parameters at {backbone.img_size} px, {source}, {pixels}"
    if backbone.name == "vit_micro":
        presets = paper_presets(cfg)
        how = f"experiment={presets[0]}" if presets else "backbone=deit_small_patch16_224 backbone.pretrained=true"
        first += f". This is clbench's embedded micro ViT, not a paper's backbone: for the paper's setting use {how}"
    precision = "bf16 autocast" if uses_bf16(rt.device, cfg.trainer.precision) else "fp32"
    device = f"{rt.device} ({torch.cuda.get_device_name(rt.device)})" if rt.device.type == "cuda" else str(rt.device)
    ranks = f" x {rt.ranks.size} processes" if rt.ranks.size > 1 else ""
    lines = [first, f"runtime: {device}{ranks}, {precision}, {rt.accel.describe()}"]
    if cfg.smoke:
        lines.insert(0, f"[bold yellow]{smoke.warning()}[/bold yellow]")
    if method.memory is not None:
        memory = method.memory
        budget = f"{cfg.memory.per_class} images a class" if cfg.memory.per_class else "a fixed total"
        image = memory.images[0]
        view = "as trained on (float32)" if memory.augmented else "uint8"
        lines.append(
            f"memory: {memory.sampler} sampler, {memory.capacity} images ({budget}) of {tuple(image.shape)} {view}, "
            f"{memory.capacity * image.numel() * image.element_size() / 2**20:.1f} MiB in {memory.location}"
            + (f"; {method.replay_draws} x {replay_rows(cfg)} images replayed a step" if method.replay_draws else "")
        )
    return lines


def replay_rows(cfg: RunConfig) -> int:
    """Images of each draw from the memory in a training step (``memory.batch_size``, else the batch size)."""
    return cfg.memory.batch_size or cfg.trainer.batch_size


def paper_presets(cfg: RunConfig) -> list[str]:
    """The ``experiment=`` presets of the run's method (conf/experiment/<method>_*.yaml)."""
    method = method_name(cfg.method_target)
    return sorted(p.stem for p in (config_dir() / "experiment").glob(f"{method}_*paper*.yaml"))
