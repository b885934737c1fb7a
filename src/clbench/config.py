"""Typed schemas for the composed Hydra config, checked before any work starts.

Hydra composes plain YAML (``conf/``); :func:`validate` then merges each group into its dataclass schema, so
an unknown key or a value of the wrong type is rejected by OmegaConf, and each schema's ``__post_init__``
rejects values outside their allowed range. Every message names the key, the value and what is allowed.
A method's hyperparameters are validated against the ``Config`` dataclass that the method class declares, and each
of its floats must be finite (:func:`require_finite`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from clbench import metrics
from clbench.errors import ClbenchError, ConfigError, DataError


def config_dir() -> Path:
    """The configs shipped in the wheel (clbench/conf), or the source tree's conf/ in an editable install."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf"


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise a :class:`ConfigError` naming ``key``, ``value`` and what is ``allowed`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"Invalid value for `{key}`: {value!r}. Allowed: {allowed}.")


def require_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    require(value in choices, key, value, "one of " + ", ".join(choices))


SCHEDULES = ("cosine", "constant", "exponential", "multistep", "plateau", "coda_cosine")  # trainer.schedule's names
PROTOCOLS = ("clbench", "P", "D-clbench", "D-jax", "D-pytorch", "D-coda")  # data.protocol's names
# data.transforms=pilot: PILOT's build_transform (utils/data.py), as these keys spell it; image files are stored at
# 256 px, the test resize, so that the stored square's centre is Resize(256) + CenterCrop(224) of the image.
PILOT_TRANSFORMS = {
    "train_crop": "resized",
    "resized_crop_scale": (0.05, 1.0),
    "hflip": True,
    "randaugment_ops": 0,
    "random_erasing": 0.0,
    "test_resize": 256,
    "brightness": 0.0,
}

# Sources a class-split benchmark reads (clbench.data.sources.BUILT_IN, plus image_folder); those of image files of any
# size need data.store_size.
FILE_SOURCES = ("image_folder", "gtsrb", "flowers102", "stanford_cars", "cub200")
SOURCES = ("digits", "synthetic", "cifar10", "cifar100", "mnist", "fashion_mnist", "svhn", *FILE_SOURCES)


@dataclass
class DataConfig:
    """A benchmark: a source split into tasks of disjoint classes."""

    name: str  # recorded in results.json, e.g. cifar100_10tasks
    source: str  # one of SOURCES (a built-in reader, image_folder) or sequence (one task per dataset)
    tasks: int  # number of tasks the classes are split into (sequence: one per dataset)
    root: str = "data"  # where downloadable sources live (data.root=/datasets)
    download: bool = False  # fetch the official archive into root if it is missing
    verify_checksums: bool = True  # false accepts a copy made by hand
    num_tasks: int | None = None  # train and evaluate only the first N tasks
    # The class order: np.random.seed(seed); np.random.permutation(N) (NumPy's legacy generator, as iCaRL, PyCIL and
    # PILOT draw it; 1993 is their seed); null keeps the natural order (sorted folder names, the dataset's label ids)
    class_order_seed: int | None = 1993
    # The task split: null cuts the classes into `tasks` near-equal tasks; set (with increment), PILOT's rule: a first
    # task of init_classes, then tasks of `increment` while they fit, the remainder as a last task ("B0 IncX": both X)
    init_classes: int | None = None
    increment: int | None = None  # ... the classes of every later task (PILOT's increment)
    # The protocol the benchmark realises, recorded and kept apart in reports: clbench (the benchmark as its docs page
    # defines it) | P (the PILOT/RevisitingCIL split archives, seed-1993 order, B0 IncX splits, PILOT's transforms) |
    # D-clbench (Protocol D, the DualPrompt-family ImageNet-R 80/20 split, as clbench's seeded per-class split makes
    # it) | D-jax, D-pytorch, D-coda (the DualPrompt JAX code's, dualprompt-pytorch's and CODA-Prompt's splits)
    protocol: str = "clbench"
    # classes: the source's classes cut into `tasks` tasks | pixel_permutations: every task holds all of the source's
    # classes, each task's images under its own fixed pixel permutation (PermutedMNIST), seeded by permutation_seed
    tasks_by: str = "classes"
    permutation_seed: int = 0  # pixel_permutations: task t's permutation is drawn by RandomState(seed + t)
    # pixel_permutations: the side the images are resized to before their pixels are permuted (null: as stored). A
    # ViT whose patch is one source pixel would see the permutation as a mere shuffle of its tokens.
    permutation_size: int | None = None
    # Image folders and sequences of datasets (one task per dataset, in the listed order).
    folder: str | None = None  # source=image_folder: the folder under root
    # An image folder's train/test split: auto (its own train/ and test/ (or val/) sub-folders where it has them, else
    # seeded) | own (they must be there: a split archive) | seeded (per class by split_seed; refused where the folder
    # has train/ and test/, which would be another split's files)
    folder_split: str = "auto"
    # folder_split=lists: the fixed train/test file lists of <folder>/<class>/* to read, by the name of a split that
    # clbench ships (coda_imagenet_r: CODA-Prompt's ImageNet-R lists) or the path of a lists file (.json or .json.gz)
    split_lists: str | None = None
    datasets: list[str] = field(default_factory=list)  # source=sequence: built-in source names or folders under root
    store_size: int | None = None  # image folders and sequences: images stored RGB at this square size
    test_fraction: float = 0.2  # folders without train/test sub-folders: the seeded per-class test share
    split_seed: int = 0  # ... and its seed (recorded with the run)
    val_fraction: float = 0.0  # stratified share of each task's training data held out for validation (0: none)
    val_seed: int = 0  # the validation split's own seed: the same split for every training seed
    decode_workers: int = 8  # threads decoding image files
    # Where the images live while training: device (decoded into memory, moved to the training device) | stream
    # (decoded once into an on-disk cache, read batch by batch by background workers) | auto (stream when the images
    # exceed half the device's free memory; says which it chose).
    store: str = "device"
    cache_dir: str | None = None  # the on-disk cache of store=stream|auto; null: <root>/clbench-cache
    stream_workers: int = 4  # store=stream: processes reading batches from the cache (0: in the training process)
    # The whole image pipeline by name: clbench (the keys below) | pilot (PILOT's build_transform: train
    # RandomResizedCrop(224, scale (0.05, 1), ratio (3/4, 4/3)) as torchvision draws it + flip, test Resize(256,
    # PIL's bicubic) + CenterCrop(224), 8-bit pixels in [0, 1], no normalisation; the keys below must hold its values)
    transforms: str = "clbench"
    # Train-time augmentation, applied in batches on the device.
    train_crop: str = "pad"  # pad: shift by up to crop_padding px | resized: RandomResizedCrop | none
    crop_padding: int = 4  # train_crop=pad: the largest shift, in pixels
    resized_crop_scale: tuple[float, float] = (0.08, 1.0)  # train_crop=resized: the crop's share of the image area
    hflip: bool = True  # random horizontal flips
    randaugment_ops: int = 0  # RandAugment per training image (torchvision's): ops per image (DeiT: 2; 0: off)
    randaugment_magnitude: int = 9  # ... their magnitude, 0..30 (DeiT: 9)
    random_erasing: float = 0.0  # probability of erasing a random box of each training image with noise (DeiT: 0.25)
    # Evaluation: resize to test_resize, then centre-crop the backbone's img_size (Resize(256) + CenterCrop(224), the
    # ImageNet test transform L2P's and DeiT's code use); null: resize straight to img_size.
    test_resize: int | None = None
    # ColorJitter(brightness=b) on training images: each image's pixels times a factor drawn from U[max(0, 1 - b),
    # 1 + b], clipped to [0, 1] (HiDe's and SLCA's CIFAR pipelines: 63/255)
    brightness: float = 0.0
    # Only for source=synthetic: class prototypes plus noise, for tests and timings without files.
    synthetic_classes: int = 10
    synthetic_train_per_class: int = 50  # training images a class
    synthetic_test_per_class: int = 10  # test images a class
    synthetic_image_size: int = 32  # side in pixels
    synthetic_channels: int = 3  # 1 (grey) or 3 (RGB)

    def __post_init__(self) -> None:
        require_choice("data.source", self.source, (*SOURCES, "sequence"))
        require_choice("data.tasks_by", self.tasks_by, ("classes", "pixel_permutations"))
        size = self.permutation_size
        require(size is None or size >= 1, "data.permutation_size", size, "null or an integer >= 1")
        if self.tasks_by == "pixel_permutations":
            require(
                self.source != "sequence" and self.store == "device",
                "data.tasks_by",
                self.tasks_by,
                "classes with source=sequence or data.store=stream|auto (permutations apply to images held in memory)",
            )
        require(self.tasks >= 1, "data.tasks", self.tasks, "an integer >= 1")
        if self.source == "image_folder":
            require(bool(self.folder), "data.folder", self.folder, "the image folder's name under data.root")
        if self.source in ("sequence", *FILE_SOURCES):
            require(self.store_size is not None and self.store_size >= 8, "data.store_size", self.store_size, ">= 8")
        if self.source == "sequence":
            require(len(self.datasets) > 0, "data.datasets", self.datasets, "a non-empty list of dataset names")
            require(
                self.tasks == len(self.datasets), "data.tasks", self.tasks, f"len(data.datasets) = {len(self.datasets)}"
            )
        require(0 < self.test_fraction < 1, "data.test_fraction", self.test_fraction, "a float in (0, 1)")
        require(0 <= self.val_fraction < 1, "data.val_fraction", self.val_fraction, "a float in [0, 1)")
        for key in ("class_order_seed", "split_seed", "val_seed", "permutation_seed"):
            value = getattr(self, key)
            ok = value is None if key == "class_order_seed" and value is None else 0 <= value < 2**32
            require(
                ok, f"data.{key}", value, "an integer in [0, 2**32)" + (" or null" if key == "class_order_seed" else "")
            )
        if self.tasks_by == "pixel_permutations":  # task t's permutation is drawn by RandomState(permutation_seed + t)
            last = 2**32 - (self.num_tasks or self.tasks)
            require(
                self.permutation_seed <= last,
                "data.permutation_seed",
                self.permutation_seed,
                f"an integer in [0, {last}] (task t's permutation is seeded permutation_seed + t, below 2**32)",
            )
        require(self.decode_workers >= 1, "data.decode_workers", self.decode_workers, "an integer >= 1")
        require_choice("data.store", self.store, ("device", "stream", "auto"))
        require(self.stream_workers >= 0, "data.stream_workers", self.stream_workers, "an integer >= 0")
        require(
            self.num_tasks is None or 1 <= self.num_tasks <= self.tasks,
            "data.num_tasks",
            self.num_tasks,
            f"null or an integer in [1, data.tasks={self.tasks}]",
        )
        require_choice("data.train_crop", self.train_crop, ("pad", "resized", "none"))
        require(self.crop_padding >= 0, "data.crop_padding", self.crop_padding, "an integer >= 0")
        require(self.randaugment_ops >= 0, "data.randaugment_ops", self.randaugment_ops, "an integer >= 0")
        ok = 0 <= self.randaugment_magnitude <= 30
        require(ok, "data.randaugment_magnitude", self.randaugment_magnitude, "an integer in [0, 30]")
        require(0 <= self.random_erasing <= 1, "data.random_erasing", self.random_erasing, "a probability in [0, 1]")
        require(0 <= self.brightness < math.inf, "data.brightness", self.brightness, "a float >= 0")
        scale = list(self.resized_crop_scale)
        require(
            len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1,
            "data.resized_crop_scale",
            scale,
            "[lo, hi], 0 < lo <= hi <= 1",
        )
        for key in ("synthetic_classes", "synthetic_train_per_class", "synthetic_test_per_class"):
            require(getattr(self, key) >= 1, f"data.{key}", getattr(self, key), "an integer >= 1")
        require(self.synthetic_image_size >= 4, "data.synthetic_image_size", self.synthetic_image_size, ">= 4")
        require(self.synthetic_channels in (1, 3), "data.synthetic_channels", self.synthetic_channels, "1 or 3")
        self._check_protocol()

    def _check_split_lists(self) -> None:
        """data.split_lists goes with folder_split=lists, names lists that exist, and D-coda means CODA's lists."""
        from clbench.data.split_lists import lists_path, shipped_names

        lists = self.folder_split == "lists"
        require(
            (self.split_lists is not None) == lists,
            "data.split_lists",
            self.split_lists,
            "the lists to read with data.folder_split=lists" if lists else "null unless data.folder_split=lists",
        )
        if self.split_lists is not None:
            require(self.source == "image_folder", "data.source", self.source, "image_folder with data.split_lists")
            try:
                lists_path(self.split_lists)
            except DataError:
                allowed = f"a split clbench ships ({', '.join(shipped_names())}) or a lists file"
                require(False, "data.split_lists", self.split_lists, allowed)
        if self.protocol == "D-coda":
            require(
                self.split_lists == "coda_imagenet_r",
                "data.split_lists",
                self.split_lists,
                "coda_imagenet_r with data.protocol=D-coda (CODA-Prompt's lists, data.folder_split=lists)",
            )

    def _check_protocol(self) -> None:
        """The task split rule, the named pipeline and the protocol label: each name means what it says."""
        require_choice("data.protocol", self.protocol, PROTOCOLS)
        require_choice("data.folder_split", self.folder_split, ("auto", "own", "seeded", "lists"))
        self._check_split_lists()
        require_choice("data.transforms", self.transforms, ("clbench", "pilot"))
        for key in ("init_classes", "increment"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"data.{key}", value, "null or an integer >= 1")
        require(
            (self.init_classes is None) == (self.increment is None),
            "data.increment" if self.increment is None else "data.init_classes",
            self.increment if self.increment is None else self.init_classes,
            "set together with data.init_classes and data.increment (PILOT's rule needs both), or both null",
        )
        if self.increment is not None:
            require(
                self.source != "sequence" and self.tasks_by == "classes",
                "data.increment",
                self.increment,
                "null with source=sequence or tasks_by=pixel_permutations (one task per dataset or permutation)",
            )
        if self.transforms == "pilot":
            pilot = {**PILOT_TRANSFORMS, **({"store_size": 256} if self.source in ("sequence", *FILE_SOURCES) else {})}
            for key, value in pilot.items():
                found = tuple(getattr(self, key)) if key == "resized_crop_scale" else getattr(self, key)
                require(found == value, f"data.{key}", found, f"{value} with data.transforms=pilot (PILOT's own value; "
                        "data.transforms=clbench to change it)")  # fmt: skip
        if self.protocol == "P":
            require(self.increment is not None, "data.increment", None, "PILOT's increment with data.protocol=P")
            require(self.transforms == "pilot", "data.transforms", self.transforms, "pilot with data.protocol=P")
            require(
                self.source != "image_folder" or self.folder_split == "own",
                "data.folder_split",
                self.folder_split,
                "own with data.protocol=P (the split archive's train/ and test/ folders)",
            )


@dataclass
class BackboneConfig:
    """A timm Vision Transformer; ``model`` is a timm name, ``kwargs`` override its architecture."""

    name: str  # label recorded in results.json
    model: str  # timm model name
    img_size: int = 224  # input side in pixels: images are resized to it on the device
    tag: str | None = None  # pretrained tag, e.g. orig_in21k (L2P) or fb_in1k (DeiT)
    pretrained: bool = False  # load the tagged weights from the Hugging Face hub (or its cache)
    weights: str | None = None  # a local .safetensors/.pth/.npz checkpoint; no network needed
    normalize: bool = True  # normalise pixels with the weights' mean/std (false: pixels in [0, 1], as L2P)
    # normalize=true: the mean and std (one per channel) to normalise with instead of the weights' own, as a code that
    # normalises with its dataset's statistics does (CIFAR-100's: [0.5071, 0.4867, 0.4408], [0.2675, 0.2565, 0.2761])
    input_mean: list[float] | None = None
    input_std: list[float] | None = None
    drop_path_rate: float = 0.0  # stochastic depth while training (DeiT-S: 0.1)
    refiner: bool = False  # Refiner attention (expansion, distributed local attention, reduction) in every block
    refiner_expand: int = 3  # expansion ratio of the attention heads (Refiner: 3)
    refiner_kernel: int = 3  # kernel of the distributed local attention (Refiner: 3)
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to timm.create_model, e.g. {depth: 2}

    def __post_init__(self) -> None:
        require(self.img_size >= 8, "backbone.img_size", self.img_size, "an integer >= 8")
        require(self.refiner_expand >= 1, "backbone.refiner_expand", self.refiner_expand, "an integer >= 1")
        ok = self.refiner_kernel >= 1 and self.refiner_kernel % 2 == 1
        require(ok, "backbone.refiner_kernel", self.refiner_kernel, "an odd integer >= 1")
        require(0 <= self.drop_path_rate < 1, "backbone.drop_path_rate", self.drop_path_rate, "a float in [0, 1)")
        self._check_input_stats()
        if self.weights is not None:
            require(
                Path(self.weights).suffix in (".safetensors", ".pth", ".pt", ".bin", ".npz"),
                "backbone.weights",
                self.weights,
                "a path ending in .safetensors, .pth, .pt, .bin or .npz",
            )

    def _check_input_stats(self) -> None:
        """Own statistics come as a pair, three finite values each (std > 0), and only where pixels are normalised."""
        given = (self.input_mean is not None, self.input_std is not None)
        key = "backbone.input_std" if given[0] else "backbone.input_mean"
        require(given[0] == given[1], key, None, "set together with the other (a mean and a std per channel)")
        if not given[0]:
            return
        require(self.normalize, "backbone.normalize", False, "true with backbone.input_mean and backbone.input_std")
        for key, values, low in (("input_mean", self.input_mean, -math.inf), ("input_std", self.input_std, 0.0)):
            ok = len(values) == 3 and all(math.isfinite(v) and v > low for v in values)
            require(ok, f"backbone.{key}", list(values), "three finite floats" + (" > 0" if low == 0 else ""))


@dataclass
class TrainerConfig:
    """The loop's optimisation and runtime settings; methods' YAMLs set their papers' values."""

    epochs: int = 5  # epochs per task (0: no training)
    batch_size: int = 32  # training batch; under torchrun the global batch, shared by the ranks
    drop_last: bool = False  # drop each training epoch's last partial batch (DataLoader(drop_last=True): CODA-Prompt)
    eval_batch_size: int = 256  # evaluation batch
    lr: float = 1e-3  # peak learning rate (a method's optimizer groups may carry their own)
    lr_scale_batch: int | None = None  # linear scaling rule: lr * batch_size / lr_scale_batch (null: off)
    optimizer: str = "adamw"  # adamw | adam | sgd | adamw_bert (BERT's: no bias correction, eps 1e-6)
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0  # not on biases, norms and position/class tokens (unless a method's group sets its own)
    # cosine | constant | exponential | multistep | coda_cosine, per phase | plateau (HAT's, on validation);
    # coda_cosine: CODA-Prompt's CosineSchedule (InfLoRA's too), epoch e of K at cos(99 pi max(e - 1, 0) / (200 (K-1)))
    schedule: str = "cosine"
    # exponential: the lr's factor after each epoch (staircase; APD's code: 0.95); multistep: at each milestone
    lr_decay: float = 0.95
    milestones: list[int] = field(
        default_factory=list
    )  # multistep: the epochs of a phase from which lr x lr_decay again
    # cosine: the rate moves along the cosine every batch | once an epoch (a torch scheduler stepped after each epoch)
    schedule_steps: str = "batch"
    cosine_epochs: int | None = None  # cosine: its length in epochs (null: the phase's); a shorter one rises again
    plateau_patience: int = 5  # plateau: epochs without a better validation loss before the lr is divided
    plateau_factor: float = 3.0  # plateau: the divisor (HAT: 3); the phase stops once lr falls below min_lr
    warmup_epochs: float = 0.0  # linear warm-up at the start of each phase
    min_lr: float = 0.0  # floor of the cosine schedule
    grad_clip: float | None = None  # max global grad norm (null: off)
    mixup: float = 0.0  # mixup's alpha (timm's Mixup; DeiT: 0.8); 0: off
    cutmix: float = 0.0  # cutmix's alpha (DeiT: 1.0); with both, a batch takes one of the two (DeiT's switch 0.5)
    label_smoothing: float = 0.0  # of the mixed targets (DeiT: 0.1); only with mixup or cutmix
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    eval_random_init: bool = True  # measure b_j (accuracy before any training) for FWT
    # The classes CIL's argmax runs over: seen (the protocol: every class of the tasks trained so far) | all (every
    # class of the benchmark, the untrained heads' scores included: the official L2P and DualPrompt codes' evaluation)
    cil_classes: str = "seen"
    log_every: int = 20  # train-loss logging period in steps (each log is one host sync)
    # torch.compile the method's forward and loss: auto (on CUDA; off on the CPU, where compiling costs more than it
    # saves) | true | false. A compile failure warns once and trains eagerly.
    compile: bool | str = "auto"
    # The whole training step as one CUDA graph, replayed for every full batch: auto (on CUDA where the step is
    # static: one process, no host-drawn augmentation) | true (refused where it cannot be) | false.
    cuda_graphs: bool | str = "auto"
    checkpoint_every: int = 1  # epochs between checkpoints (0: only at the end of each task)

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "eval_batch_size", "log_every", "checkpoint_every"):
            minimum = 0 if key in ("epochs", "checkpoint_every") else 1
            value = getattr(self, key)
            require(value >= minimum, f"trainer.{key}", value, f"an integer >= {minimum}")
        require(math.isfinite(self.lr) and self.lr > 0, "trainer.lr", self.lr, "a finite float > 0")
        require(
            self.lr_scale_batch is None or self.lr_scale_batch > 0,
            "trainer.lr_scale_batch",
            self.lr_scale_batch,
            "null or an integer > 0",
        )
        require_choice("trainer.optimizer", self.optimizer, ("adamw", "adam", "sgd", "adamw_bert"))
        require(0 <= self.momentum < 1, "trainer.momentum", self.momentum, "a float in [0, 1)")
        require(self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, "a float >= 0")
        require_choice("trainer.schedule", self.schedule, SCHEDULES)
        require(0 < self.lr_decay <= 1, "trainer.lr_decay", self.lr_decay, "a float in (0, 1]")
        milestones = list(self.milestones)
        require(
            all(isinstance(m, int) and m >= 1 for m in milestones) and milestones == sorted(set(milestones)),
            "trainer.milestones",
            milestones,
            "increasing epochs >= 1, e.g. [18]",
        )
        require(
            self.schedule != "multistep" or bool(milestones),
            "trainer.milestones",
            milestones,
            "at least one epoch with trainer.schedule=multistep, e.g. [18]",
        )
        require_choice("trainer.schedule_steps", self.schedule_steps, ("batch", "epoch"))
        ok = self.cosine_epochs is None or self.cosine_epochs >= 1
        require(ok, "trainer.cosine_epochs", self.cosine_epochs, "null (the phase's epochs) or an integer >= 1")
        require(self.plateau_patience >= 1, "trainer.plateau_patience", self.plateau_patience, "an integer >= 1")
        require(self.plateau_factor > 1, "trainer.plateau_factor", self.plateau_factor, "a float > 1")
        require(self.warmup_epochs >= 0, "trainer.warmup_epochs", self.warmup_epochs, "a float >= 0")
        require(
            0 <= self.min_lr <= self.lr,
            "trainer.min_lr",
            self.min_lr,
            f"a float in [0, trainer.lr={self.lr}]",
        )
        require(self.grad_clip is None or self.grad_clip > 0, "trainer.grad_clip", self.grad_clip, "null or > 0")
        for key in ("mixup", "cutmix"):
            require(getattr(self, key) >= 0, f"trainer.{key}", getattr(self, key), "an alpha >= 0 (0: off)")
        require(0 <= self.label_smoothing < 1, "trainer.label_smoothing", self.label_smoothing, "a float in [0, 1)")
        require_choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        require_choice("trainer.precision", self.precision, ("auto", "bf16", "fp32"))
        require_choice("trainer.cil_classes", self.cil_classes, ("seen", "all"))
        for key in ("compile", "cuda_graphs"):
            value = getattr(self, key)
            require(value in (True, False, "auto"), f"trainer.{key}", value, "auto, true or false")
        require(
            not (self.cuda_graphs is True and self.device == "cpu"),
            "trainer.cuda_graphs",
            True,
            "auto or false with trainer.device=cpu (CUDA graphs need a CUDA device)",
        )


@dataclass
class LoggerConfig:
    """Weights & Biases settings; the run folder is written whatever the mode."""

    mode: str = "offline"  # offline (sync later with `wandb sync`) | online | disabled
    project: str = "clbench"  # the W&B project
    entity: str | None = None  # the W&B team or user (null: your default)
    group: str | None = None  # null: <method>-<benchmark>-<backbone>-<hash of the config less the seed>
    name: str | None = None  # null: the job's overrides, e.g. method=meat,seed=1
    tags: list[str] = field(default_factory=list)  # added to method:<m>, benchmark:<b>, backbone:<b>
    online_timeout: float = 30.0  # seconds online mode may take to connect before falling back to offline

    def __post_init__(self) -> None:
        require_choice("logger.mode", self.mode, ("offline", "online", "disabled"))
        require(self.online_timeout > 0, "logger.online_timeout", self.online_timeout, "a float > 0 (seconds)")


@dataclass
class MemoryConfig:
    """A rehearsal memory of training images (``memory=none``: no budget, no memory). ``per_class``: every seen class
    keeps exactly that many images (the memory grows to per_class x the benchmark's classes: L2P Table 1's buffer
    sizes); ``size``: a fixed total from the first task on, shared by the seen classes (reservoir: by the stream)."""

    sampler: str = "auto"  # auto (the method's paper's) | reservoir | uniform | balanced | herding | greedy
    per_class: int | None = None  # images kept a class (null: no per-class budget)
    size: int | None = None  # a fixed total number of images (null: no fixed budget)
    batch_size: int | None = None  # memory images a replayed draw adds to each step (null: trainer.batch_size)
    # herding: after each task, the old classes' images chosen again by herding on the current model's features (BiC's
    # code) | false: an old class keeps the first ones chosen (iCaRL's ReduceExemplarSet)
    reselect: bool = False
    # what a step sampler stores: raw (the image as the benchmark stores it, augmented again at every draw: mammoth's)
    # | augmented (the view the step that stored it trained on, replayed as stored: L2P's buffer; float32 at the
    # model's input size)
    view: str = "raw"

    def __post_init__(self) -> None:
        require_choice("memory.sampler", self.sampler, ("auto", *SAMPLERS))
        require_choice("memory.view", self.view, ("raw", "augmented"))
        for key in ("per_class", "size", "batch_size"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"memory.{key}", value, "null or an integer >= 1")
        require(
            self.per_class is None or self.size is None,
            "memory.size",
            self.size,
            f"null with memory.per_class={self.per_class} (a budget is per_class or size, not both: add "
            f"memory.size=null to keep {self.per_class} images a class, or memory.per_class=null to keep {self.size} "
            "in all)",
        )

    @property
    def active(self) -> bool:
        return self.per_class is not None or self.size is not None


SAMPLERS = ("reservoir", "uniform", "balanced", "herding", "greedy")
STEP_SAMPLERS = ("reservoir", "uniform")  # fill during training steps; the others after a task (a `memory` phase)
HOLDING_OUT = ("herding", "balanced")  # the samplers that hold a validation share of each class out (BiC's bias stage)


@dataclass
class RunConfig:
    """Everything a run needs, typed; ``method`` is the method's own ``Config`` instance."""

    data: DataConfig
    backbone: BackboneConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    memory: MemoryConfig
    method: Any
    method_target: str
    seed: int = 0  # training seed (initialisation, shuffling, augmentation); the class order has its own
    resume: bool | str = False  # True | False | "auto" (resume only where a checkpoint exists)
    objective: str | None = None  # the metric a job returns to a sweeper, e.g. validation.cil.final_acc
    objective_on_test: bool = False  # let `objective` read a test metric (selection on test: opt-in, warned)
    smoke: bool = False  # a few images a class and one step a phase: the run end to end in a minute, never a result


GROUPS = {
    "data": DataConfig,
    "backbone": BackboneConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "memory": MemoryConfig,
}


def register_schemas() -> None:
    """Store each group's dataclass as ``schema/<group>``; every YAML of the group starts from it
    (``defaults: [/schema/<group>@_here_, _self_]``), so a YAML lists only what it changes and every field,
    set in the YAML or not, can be overridden from the command line and is type-checked while composing."""
    store = ConfigStore.instance()
    for group, schema in GROUPS.items():
        store.store(group="schema", name=group, node=schema)


register_schemas()  # importing the schemas makes them composable: the CLI, the tests and the bench compose alike


def closest(key: str, allowed: list[str]) -> str | None:
    """The allowed key a mistyped ``key`` most likely meant (difflib), or None."""
    match = difflib.get_close_matches(key, allowed, 1)
    return match[0] if match else None


def refuse_unknown(keys: Any, allowed: list[str], where: str) -> None:
    """Refuse keys that are not in ``allowed`` (a typo added with ``+``, say), suggesting the closest allowed key."""
    unknown = sorted(str(k) for k in set(keys) - set(allowed))
    if unknown:
        hints = [f"`{k}` (did you mean `{m}`?)" if (m := closest(k, allowed)) else f"`{k}`" for k in unknown]
        raise ConfigError(f"Unknown key(s) in {where}: {', '.join(hints)}. Allowed: {', '.join(sorted(allowed))}.")


def _typed(schema: type, node: Any, key: str) -> Any:
    """Merge ``node`` into ``schema`` and build the dataclass (running its checks)."""
    if not isinstance(node, DictConfig):
        raise ConfigError(f"`{key}` is missing or not a mapping; pick one with `{key}=<name>`.")
    refuse_unknown(node.keys(), [f.name for f in dataclasses.fields(schema)], f"`{key}`")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        detail = str(err).split("\n")[0]
        full_key = getattr(err, "full_key", None)
        where = f"`{key}.{full_key}`" if full_key else f"`{key}`"
        raise ConfigError(f"Invalid config at {where}: {detail}") from None


def require_finite(config: Any, key: str) -> None:
    """Refuse an infinite or NaN float in the dataclass ``config`` (a float field, or a float in a list or tuple): a
    weight, temperature or rate of inf trains to NaN or saturates without a word. A field whose meaning allows inf
    says so with ``field(metadata={"allow_inf": True})`` (NaN is never allowed)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                allow_inf = bool(f.metadata.get("allow_inf"))
                allowed = "a finite float" + (" or inf" if allow_inf else " (inf and nan are not allowed)")
                require(allow_inf and not math.isnan(item), f"{key}.{f.name}", value, allowed)


def validate(cfg: DictConfig) -> RunConfig:
    """Check the whole composed config; return it typed. Raises :class:`ConfigError` with a clear message."""
    allowed = {*GROUPS, "method", "seed", "resume", "objective", "objective_on_test", "smoke"}
    refuse_unknown(cfg.keys(), sorted(allowed), "the top level")
    groups = {key: _typed(schema, cfg.get(key), key) for key, schema in GROUPS.items()}
    method_node = cfg.get("method")
    if not isinstance(method_node, DictConfig) or "_target_" not in method_node:
        raise ConfigError("`method` must name a method config with a `_target_`, e.g. `method=finetune`.")
    target = str(method_node._target_)
    try:
        method_cls = get_class(target)
    except Exception as err:
        stop = err  # a stop signal while importing (clbench.cli's handler), which Hydra wraps in an ImportError
        while stop is not None and not isinstance(stop, ClbenchError):
            stop = stop.__cause__ or stop.__context__
        if stop is not None:
            raise stop from None
        raise ConfigError(f"`method._target_`={target!r} cannot be imported: {err}") from None
    params = OmegaConf.masked_copy(method_node, [k for k in method_node if k != "_target_"])
    method = _typed(method_cls.Config, params, "method")
    require_finite(method, "method")
    check_memory(groups["memory"], method_cls)
    method_cls.check_trainer(method, groups["trainer"])
    require(
        groups["trainer"].cil_classes == "seen" or method_cls.scores_unseen_classes(),
        "trainer.cil_classes",
        "all",
        f"seen with {method_cls.__name__}: it infers the task (or has its own CIL), so it has no scores for the "
        "classes of tasks it has not trained",
    )
    seed = cfg.get("seed", 0)
    require(isinstance(seed, int) and 0 <= seed < 2**32, "seed", seed, "an integer in [0, 2**32) (NumPy's seed range)")
    resume = cfg.get("resume", False)
    require(isinstance(resume, bool) or resume == "auto", "resume", resume, "true, false or auto")
    test_resize, img_size = groups["data"].test_resize, groups["backbone"].img_size
    require(
        test_resize is None or test_resize >= img_size,
        "data.test_resize",
        test_resize,
        f"null or an integer >= backbone.img_size={img_size} (resize, then centre-crop img_size)",
    )
    require(
        groups["trainer"].schedule != "plateau" or groups["data"].val_fraction > 0,
        "trainer.schedule",
        "plateau",
        "plateau once data.val_fraction > 0 (e.g. 0.1): it reads the validation loss after every epoch",
    )
    check_backbone(groups["backbone"], groups["data"])
    blocker = host_drawn_augmentation(groups["trainer"], groups["data"])
    require(
        groups["trainer"].cuda_graphs is not True or blocker is None,
        "trainer.cuda_graphs",
        True,
        f"auto or false here: {blocker}",
    )
    objective, on_test = cfg.get("objective"), cfg.get("objective_on_test", False)
    require(isinstance(on_test, bool), "objective_on_test", on_test, "true or false")
    if objective is not None:
        check_objective(str(objective), on_test, groups["data"])
    smoke = cfg.get("smoke", False)
    require(isinstance(smoke, bool), "smoke", smoke, "true or false")
    run = RunConfig(
        **groups,
        method=method,
        method_target=target,
        seed=seed,
        resume=resume,
        objective=None if objective is None else str(objective),
        objective_on_test=on_test,
        smoke=smoke,
    )
    method_cls.check_run(run)
    if not smoke:
        return run
    from clbench.smoke import shrunk

    return shrunk(run)


def check_backbone(backbone: BackboneConfig, data: DataConfig) -> None:
    """Weights named by their exact tag; PILOT's pipeline (``data.transforms=pilot``) at 224 px without
    normalisation, as PILOT feeds its ViTs."""
    from clbench.backbones.timm_vit import require_tag  # timm: imported only once a run's config is checked

    require_tag(backbone)
    if data.transforms == "pilot":
        require(
            backbone.img_size == 224,
            "backbone.img_size",
            backbone.img_size,
            "224 with data.transforms=pilot (PILOT's ViT-B/16 input; e.g. backbone=vit_base_patch16_224_augreg_in21k)",
        )
        require(
            not backbone.normalize,
            "backbone.normalize",
            True,
            "false with data.transforms=pilot (PILOT feeds pixels in [0, 1]; data.transforms=clbench to normalise)",
        )


def memory_sampler(memory: MemoryConfig, method_cls: type) -> str:
    """The sampler a run's memory uses: ``memory.sampler``, or the method's paper's for ``auto``."""
    return method_cls.memory_sampler if memory.sampler == "auto" else memory.sampler


def check_memory(memory: MemoryConfig, method_cls: type) -> None:
    """A budget only for a method that can replay; a method that needs a memory gets one; DER++'s logits come from
    the reservoir, which stores them during the step."""
    name = method_cls.__name__
    if memory.active and method_cls.memory_sampler is None:
        key, value = ("per_class", memory.per_class) if memory.per_class is not None else ("size", memory.size)
        raise ConfigError(
            f"Invalid value for `memory.{key}`: {value}. Allowed: null (memory=none) with {name}, which has no use for "
            "a rehearsal memory (methods that replay: er, derpp, gdumb, bic, l2p)."
        )
    require(
        memory.active or not method_cls.needs_memory,
        "memory.per_class",
        None,
        f"an integer >= 1 (or memory.size): {name} rehearses from a memory and needs a budget (memory=none drops the "
        "one its YAML or preset sets)",
    )
    require(
        not (memory.active and method_cls.memory_logits and memory_sampler(memory, method_cls) != "reservoir"),
        "memory.sampler",
        memory.sampler,
        f"auto or reservoir with {name}: the logits it replays are stored during the training step",
    )
    require(
        not (memory.active and method_cls.memory_holdout and memory_sampler(memory, method_cls) not in HOLDING_OUT),
        "memory.sampler",
        memory.sampler,
        f"auto, {' or '.join(HOLDING_OUT)} with {name}: its bias stage trains on the validation images these samplers "
        "hold out of each class",
    )
    require(
        not (memory.active and memory.view == "augmented" and memory_sampler(memory, method_cls) not in STEP_SAMPLERS),
        "memory.view",
        "augmented",
        f"raw with the {memory_sampler(memory, method_cls)} sampler: it chooses after the task, from images no step "
        f"augmented (augmented: {' or '.join(STEP_SAMPLERS)})",
    )
    require(
        not (memory.active and memory.reselect and memory_sampler(memory, method_cls) != "herding"),
        "memory.reselect",
        True,
        f"false with the {memory_sampler(memory, method_cls)} sampler: only herding chooses the old classes' images "
        "again",
    )


def host_drawn_augmentation(trainer: TrainerConfig, data: DataConfig) -> str | None:
    """Why a training step cannot be replayed as one CUDA graph whatever the device: an augmentation that draws its
    random choices on the host for every batch or image (a graph would replay the first draw); None if none does."""
    if trainer.mixup or trainer.cutmix:
        return "trainer.mixup/cutmix draw the mixing on the host for every batch"
    if data.randaugment_ops:
        return "data.randaugment_ops draws each image's operations on the host"
    if data.random_erasing:
        return "data.random_erasing draws each image's box on the host"
    return None


def check_objective(name: str, on_test: bool, data: DataConfig) -> None:
    """A sweep selects by validation: a test metric needs ``objective_on_test=true``; a validation metric needs a
    validation split. A metric that can never have a value is refused: FWT on validation (no accuracy is measured
    there before a task starts) and forgetting, BWT and FWT of a run with one task."""
    parsed = metrics.parse_objective(name)
    require(parsed is not None, "objective", name, f"[validation.]<til|cil>.<{'|'.join(metrics.NAMES)}>")
    split, _, metric = parsed if parsed else ("test", "", "")
    require(
        not (split == "validation" and metric == "fwt"),
        "objective",
        name,
        "a metric measured on validation: FWT is not (it needs each task's accuracy before it is trained, measured "
        "on test only); use final_acc, avg_incremental_acc, forgetting, forgetting_l2p or bwt",
    )
    tasks = data.num_tasks or data.tasks
    require(
        tasks > 1 or metric in metrics.ONE_TASK,
        "objective",
        name,
        f"{', '.join(metrics.ONE_TASK)} with one task (data.num_tasks={tasks}): {metric} needs two tasks or more",
    )
    require(
        split == "validation" or on_test,
        "objective",
        name,
        f"validation.{name} with data.val_fraction > 0 (e.g. 0.1): {name} reads the test set, and a sweep that selects "
        "by it tunes on test data and overstates the result; or opt in with objective_on_test=true",
    )
    require(
        split == "test" or data.val_fraction > 0,
        "objective",
        name,
        f"{name} once data.val_fraction > 0 (e.g. 0.1) holds out that share of each task's training data",
    )


def as_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as a plain dict (for results.json and W&B)."""
    return dataclasses.asdict(obj)


def full_config(cfg: RunConfig) -> dict[str, Any]:
    """The whole resolved config as plain data, as the command line would set it: results.json's ``config`` and the
    W&B run's config. It holds no secret: W&B's API key lives in the environment or ~/.netrc, never in the config."""
    groups = {key: as_dict(getattr(cfg, key)) for key in GROUPS}
    method = {"_target_": cfg.method_target, **as_dict(cfg.method)}
    top = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in {*GROUPS, "method"}}
    return {"method": method, **groups, **{k: v for k, v in top.items() if k != "method_target"}}
