"""Gaussian classifier alignment: per-class feature Gaussians, and a head-only stage that trains on samples of them
instead of images. One part, shared by the methods that align their classifier this way (SLCA; MOS, TUNA and
HiDe-Prompt's copies differ only in the options of :class:`AlignmentConfig`).

The rule every copy shares (SLCA: Zhang et al., "SLCA: Slow Learner with Classifier Alignment for Continual Learning
on a Pre-trained Model", ICCV 2023, Sec. 3.3; official code GengDavid/SLCA@169d4e6 models/base.py L247-262 and
models/slca.py L174-256):

- Statistics. After a task is trained, each of its classes c gets, from the features x of its training images (test
  transform, no augmentation), mu_c = (1/n) sum x and Sigma_c = (sum x x^T - n mu_c mu_c^T) / (n - 1) + eps I
  (torch.cov's unbiased estimate plus a ridge, eps = 1e-4). The sums are fp64 and are added up over the ranks of a
  multi-process run. Old classes keep the statistics of their own task (no drift correction, by design). Sigma_c is
  kept as its Cholesky factor L_c (fp32), so a sample is mu + L z without a factorisation per epoch;
  ``covariance=diagonal`` keeps the standard deviations instead (MOS's ``variance``).
- Alignment (a phase with ``data="features"``, from the second task on). Each epoch draws ``samples_per_class``
  samples of N(s_c mu_c, Sigma_c) for every seen class (s_c: the mean shrink), shuffles them and takes batches of
  ``batch_size`` (every sample, or with ``steps=old`` as many batches as there are old classes: HiDe's); the heads
  alone train, with cross-entropy over every seen class, under their own SGD (momentum, weight decay on every head
  parameter) and a cosine schedule stepped once an epoch. The draw of (run seed, task, epoch) comes from a generator
  of its own, so the run's random stream is untouched and a resumed epoch draws the features it was interrupted on.

Multi-centroid statistics (``centroids`` k > 1, HiDe-Prompt's ``multi-centroid``: thu-ml/HiDe-Prompt@0ed4333
engines/hide_tii_engine.py L175-202): the features of each class are clustered by k-means (k clusters, a fixed seed
where the code seeds none) and each cluster keeps its mean and per-dimension variance (NumPy's ``var``, ddof 0); a
sample of a cluster is its mean + sqrt(var + ridge) z. A cluster whose variance is zero (one image) draws nothing, as
the code skips it; every cluster's mean is kept (HiDe's prototype loss reads them all). The observe pass keeps the
task's features, row by row, until the clustering (rows are added up over the ranks: each rank fills its own).

SLCA's mean shrink: s_c = 0.9 + 0.1 (k_c + 1) / (t + 1) for a class of task k_c at stage t (older tasks' means shrunk
more, the current task's x 1; slca.py L199-202). TUNA's code computes the same expression with the task size's sign
flipped (``tuna_code``: k_c = floor(c / -increment), the newest classes shrunk most). SLCA's logit normalisation
(``logit_norm`` tau, slca.py L228-242): the loss reads z / (mean_k ||z_k||_2 + 1e-7) / tau, ||z_k|| the norm of task
k's block of the logits. ``restore``: before the next task each head returns to the copy kept before alignment
(SLCA's ``fc.backup``/``fc.recall``), so the next alignment starts again from the heads as their tasks trained them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from clbench.config import require, require_choice, require_finite
from clbench.data import Split, Task
from clbench.methods.base import Phase

COVARIANCES = ("full", "diagonal")
SHRINKS = ("none", "slca", "tuna_code")
STEPS = ("all", "old", "seen")


@dataclass
class AlignmentConfig:
    """The alignment stage's options; the defaults are SLCA's official values (models/slca.py)."""

    epochs: int = 5  # alignment epochs a task, from the second task on (ca_epochs, L26); 0: no alignment
    samples_per_class: int = 256  # samples drawn for each seen class every epoch (num_sampled_pcls, L197)
    batch_size: int = 256  # samples a step (the slices of L222)
    # all: every drawn sample once an epoch (SLCA, MOS, TUNA) | old: one batch per old class (HiDe's code) | seen: one
    # batch per seen class
    steps: str = "all"
    covariance: str = "full"  # full: Sigma_c (torch.cov, base.py L262) | diagonal: its diagonal only (MOS's variance)
    ridge: float = 1e-4  # added to Sigma_c's diagonal (base.py L262)
    mean_shrink: str = "slca"  # none | slca: mu_c (0.9 + 0.1 (k_c + 1) / (t + 1)) (L199-202) | tuna_code
    logit_norm: float | None = 0.1  # tau of the logit normalisation (ca_with_logit_norm; Cars 0.05); null: plain CE
    lr: float = 0.01  # the heads' SGD learning rate (lrate, L18, L181-183)
    momentum: float = 0.9  # (L183)
    weight_decay: float = 5e-4  # on every head parameter, biases included (L181-183)
    cosine_epochs: int | None = None  # the cosine's length in epochs (T_max; null: epochs, L185; TUNA's code: 5)
    restore: bool = True  # heads back to their pre-alignment copy before the next task (fc.recall, L75-79)
    centroids: int = 1  # 1: one Gaussian a class | k > 1: k-means clusters a class, each a mean and variance (HiDe)
    kmeans_seed: int = 0  # the k-means initialisation's seed (HiDe's code seeds none)

    def __post_init__(self) -> None:
        require_finite(self, "method.alignment")
        for key in ("samples_per_class", "batch_size"):
            require(getattr(self, key) >= 1, f"method.alignment.{key}", getattr(self, key), "an integer >= 1")
        require(self.epochs >= 0, "method.alignment.epochs", self.epochs, "an integer >= 0 (0: no alignment)")
        require_choice("method.alignment.steps", self.steps, STEPS)
        require_choice("method.alignment.covariance", self.covariance, COVARIANCES)
        require_choice("method.alignment.mean_shrink", self.mean_shrink, SHRINKS)
        require(self.ridge > 0, "method.alignment.ridge", self.ridge, "a float > 0 (it keeps Sigma_c invertible)")
        tau = self.logit_norm
        require(tau is None or tau > 0, "method.alignment.logit_norm", tau, "null (plain cross-entropy) or a float > 0")
        require(self.lr > 0, "method.alignment.lr", self.lr, "a float > 0")
        require(0 <= self.momentum < 1, "method.alignment.momentum", self.momentum, "a float in [0, 1)")
        require(self.weight_decay >= 0, "method.alignment.weight_decay", self.weight_decay, "a float >= 0")
        ok = self.cosine_epochs is None or self.cosine_epochs >= 1
        require(ok, "method.alignment.cosine_epochs", self.cosine_epochs, "null (epochs) or an integer >= 1")
        require(self.centroids >= 1, "method.alignment.centroids", self.centroids, "an integer >= 1")
        ok = self.centroids == 1 or self.covariance == "diagonal"
        require(
            ok, "method.alignment.covariance", self.covariance, "diagonal with centroids > 1 (per-cluster variances)"
        )


def gaussian(
    count: torch.Tensor, total: torch.Tensor, second: torch.Tensor, ridge: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu, Sigma) of each class from its fp64 sums: ``count`` (C,), ``total`` = sum x (C, D) and ``second`` = sum x x^T
    (C, D, D), or sum x^2 (C, D) for the diagonal: Sigma = (second - n mu mu^T) / (n - 1) + ridge I (torch.cov). A class
    with fewer than two images has no spread to measure: its Sigma is the ridge alone."""
    n = count.clamp(min=1)[:, None]
    mean = total / n
    if second.dim() == 2:
        centred = second - n * mean.square()
        return mean, centred / (n - 1).clamp(min=1) + ridge
    centred = second - n[:, :, None] * mean[:, :, None] * mean[:, None, :]
    eye = torch.eye(mean.shape[1], dtype=mean.dtype, device=mean.device)
    return mean, centred / (n - 1).clamp(min=1)[:, :, None] + ridge * eye


def clustered(feats: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k-means clusters of one class's features (n, D): each cluster's mean and per-dimension variance (ddof 0) and
    its size, (k, D), (k, D), (k,); the best of 10 seeded k-means++ starts (scikit-learn 1.0's default, which HiDe's
    code ran under). With fewer than k images, each image is a cluster and the rest are empty (size 0)."""
    from sklearn.cluster import KMeans  # imported here: only multi-centroid statistics need it

    n, dim = feats.shape
    means, variances, sizes = np.zeros((k, dim)), np.zeros((k, dim)), np.zeros(k)
    found = min(k, n)
    if not found:
        return means, variances, sizes
    labels = KMeans(n_clusters=found, random_state=seed, n_init=10).fit(feats).labels_
    for j in range(found):
        members = feats[labels == j]
        means[j], variances[j], sizes[j] = members.mean(0), members.var(0), len(members)
    return means, variances, sizes


def shrink_factors(
    classes: torch.Tensor, class_task: torch.Tensor, stage: int, increment: int, rule: str
) -> torch.Tensor:
    """The factor on each class's mean at stage ``stage`` (0-based): 1 (``none``); SLCA's 0.9 + 0.1 (k + 1) / (t + 1),
    k the class's task (``slca``); TUNA's code's k = floor(c / -increment), c the class's global index and increment
    the current task's size (``tuna_code``)."""
    if rule == "none":
        return torch.ones(len(classes), dtype=torch.float64)
    k = class_task if rule == "slca" else torch.div(classes, -increment, rounding_mode="floor")
    return 0.9 + 0.1 * (k.double() + 1) / (stage + 1)


def logit_normalised(logits: torch.Tensor, sizes: list[int], tau: float) -> torch.Tensor:
    """SLCA's normalised logits: z / (mean over tasks k of (||z_k||_2 + 1e-7)) / tau, z_k task k's block (``sizes``)."""
    norms = torch.stack([block.norm(dim=1) + 1e-7 for block in logits.split(sizes, dim=1)], dim=1)
    return logits / norms.mean(dim=1, keepdim=True) / tau


def draw_seed(task_id: int, epoch: int) -> int:
    """The alignment draw's seed for (the run's seed, task, epoch): independent of the run's random stream."""
    entropy = [torch.initial_seed(), 0x0CA, task_id, epoch]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))


class TaskGaussians(nn.Module):
    """One task's class Gaussians as buffers (saved in every checkpoint): means (C, D) and Cholesky factors (C, D, D),
    or standard deviations (C, D) for the diagonal."""

    def __init__(self, num_classes: int, dim: int, diagonal: bool, device: torch.device) -> None:
        super().__init__()
        shape = (num_classes, dim) if diagonal else (num_classes, dim, dim)
        self.register_buffer("mean", torch.zeros(num_classes, dim, device=device))
        self.register_buffer("factor", torch.zeros(shape, device=device))

    def sample(self, z: torch.Tensor, shrink: torch.Tensor) -> torch.Tensor:
        """mu_c s_c + L_c z for the standard-normal draws ``z`` (C, n, D) of each class."""
        mean = (self.mean.double() * shrink[:, None]).float()[:, None, :]
        if self.factor.dim() == 2:
            return mean + z * self.factor[:, None, :]
        return mean + z @ self.factor.transpose(1, 2)


class TaskCentroids(nn.Module):
    """One task's class clusters as buffers: means and standard deviations sqrt(var + ridge) (C, k, D), and each
    cluster's size (C, k); a cluster draws samples where its variance is not zero (``live``)."""

    def __init__(self, num_classes: int, k: int, dim: int, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(num_classes, k, dim, device=device))
        self.register_buffer("factor", torch.zeros(num_classes, k, dim, device=device))
        self.register_buffer("size", torch.zeros(num_classes, k, device=device))
        self.register_buffer("live", torch.zeros(num_classes, k, dtype=torch.bool, device=device))

    def sample(self, z: torch.Tensor, shrink: torch.Tensor) -> torch.Tensor:
        """mu_ck s_c + sigma_ck z for the standard-normal draws ``z`` (C, k, n, D) of each cluster."""
        mean = (self.mean.double() * shrink[:, None, None]).float()
        return mean[:, :, None, :] + z * self.factor[:, :, None, :]


class HeadCopy(nn.Module):
    """A head's tensors as buffers: SLCA's pre-alignment copy (``fc.backup``)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        for key, value in head.state_dict().items():
            self.register_buffer(key, torch.zeros_like(value))

    @torch.no_grad()
    def keep(self, head: nn.Module) -> None:
        for key, value in head.state_dict().items():
            getattr(self, key).copy_(value)

    @torch.no_grad()
    def restore(self, head: nn.Module) -> None:
        head.load_state_dict(dict(self.named_buffers()))


class GaussianAligner(nn.Module):
    """The class Gaussians of every seen task, their statistics while a task is observed, the pre-alignment copies of
    the heads, and the alignment stage: its phase, draws and loss. A method adds a task (:meth:`add_task`), feeds
    the observe pass (:meth:`start`, :meth:`observe`, :meth:`observations`, :meth:`settle`), runs :meth:`phases` and
    trains its heads on :meth:`draw` with :meth:`loss`."""

    def __init__(self, config: AlignmentConfig, dim: int) -> None:
        super().__init__()
        self.config, self.dim = config, dim
        self.tasks = nn.ModuleList()  # TaskGaussians per task
        self.copies = nn.ModuleList()  # HeadCopy per head
        self.sums: list[torch.Tensor] | None = None  # the observed task's (count, sum x, sum x x^T) in fp64

    @property
    def diagonal(self) -> bool:
        return self.config.covariance == "diagonal"

    @property
    def clustered(self) -> bool:
        return self.config.centroids > 1

    def add_task(self, head: nn.Linear) -> None:
        """Room for a new task's Gaussians and its head's copy (zeros until observed: a resume's replay builds them)."""
        classes, device = head.out_features, head.weight.device
        if self.clustered:
            self.tasks.append(TaskCentroids(classes, self.config.centroids, self.dim, device))
        else:
            self.tasks.append(TaskGaussians(classes, self.dim, self.diagonal, device))
        self.copies.append(HeadCopy(head))

    # ----------------------------------------------------------------------------- statistics
    def start(self, rows: int = 0) -> None:
        """Zero fp64 sums for the newest task's classes (before its observe pass); with ``centroids`` > 1, room for
        the features of the task's ``rows`` training images (with their labels and how many ranks saw each row)."""
        block = self.tasks[-1]
        classes, device = block.mean.shape[0], block.mean.device
        if self.clustered:
            shapes = ((rows, self.dim), (rows,), (rows,))
            self.sums = [torch.zeros(shape, dtype=torch.float64, device=device) for shape in shapes]
            return
        second = (classes, self.dim) if self.diagonal else (classes, self.dim, self.dim)
        self.sums = [
            torch.zeros(shape, dtype=torch.float64, device=device)
            for shape in ((classes,), (classes, self.dim), second)
        ]

    @torch.no_grad()
    def observe(self, feats: torch.Tensor, local: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Add a batch of features (B, D) of the task's classes ``local`` (0 .. C-1) to the sums (no host sync);
        with ``centroids`` > 1, keep them at their ``rows`` (positions in the task's training data)."""
        assert self.sums is not None  # set by start
        x = feats.double()
        if self.clustered:
            assert rows is not None, "multi-centroid statistics keep each row's features"
            kept, labels, hits = self.sums
            kept.index_add_(0, rows, x)
            labels.index_add_(0, rows, local.double())
            hits.index_add_(0, rows, torch.ones_like(labels[rows]))
            return
        count, total, second = self.sums
        count.index_add_(0, local, torch.ones_like(local, dtype=torch.float64))
        total.index_add_(0, local, x)
        if self.diagonal:
            second.index_add_(0, local, x.square())
            return
        onehot = F.one_hot(local, count.shape[0]).to(x.dtype)  # (B, C): each class's x^T x in one batched product
        second += (onehot.T[:, :, None] * x[None]).transpose(1, 2) @ x

    def observations(self) -> list[torch.Tensor]:
        return list(self.sums) if self.sums is not None else []

    @torch.no_grad()
    def settle(self) -> None:
        """The observed task's sums -> its classes' means and factors (once; nothing pending, nothing done)."""
        if self.sums is None:
            return
        if self.clustered:
            self.settle_clusters()
            return
        mean, covariance = gaussian(*self.sums, self.config.ridge)
        block = self.tasks[-1]
        if self.diagonal:
            factor = covariance.sqrt()
        else:
            factor, info = torch.linalg.cholesky_ex(covariance)
            bad = info.nonzero().flatten().tolist()
            if bad:
                raise RuntimeError(f"class covariances {bad} of the last task are not positive definite: raise ridge")
        block.mean.copy_(mean)
        block.factor.copy_(factor)
        self.sums = None

    def settle_clusters(self) -> None:
        """The kept features of the observed task -> each class's k-means clusters (on the host, in fp64)."""
        assert self.sums is not None
        kept, labels, hits = (t.cpu() for t in self.sums)
        seen = hits > 0
        feats = (kept[seen] / hits[seen, None]).numpy()
        local = (labels[seen] / hits[seen]).round().long().numpy()
        block, c = self.tasks[-1], self.config
        for cls in range(block.mean.shape[0]):
            means, variances, sizes = clustered(feats[local == cls], c.centroids, c.kmeans_seed)
            block.mean[cls] = torch.from_numpy(means).to(block.mean)
            block.factor[cls] = torch.from_numpy(np.sqrt(variances + c.ridge)).to(block.factor)
            block.size[cls] = torch.from_numpy(sizes).to(block.size)
            block.live[cls] = torch.from_numpy(variances.mean(1) != 0).to(block.live.device)
        self.sums = None

    def means(self, tasks: int) -> torch.Tensor:
        """The class means (C, D) of the first ``tasks`` tasks, or with ``centroids`` > 1 every non-empty cluster's
        mean, in class order."""
        if not tasks:
            return torch.zeros(0, self.dim, device=self.tasks[0].mean.device)
        blocks = self.tasks[:tasks]
        if not self.clustered:
            return torch.cat([b.mean for b in blocks])
        return torch.cat([b.mean[b.size > 0] for b in blocks])

    # ----------------------------------------------------------------------------- the alignment stage
    def phases(self, task: Task, name: str = "align") -> list[Phase]:
        """The alignment phase ``name`` of ``task`` (from the second task on, unless ``epochs`` is 0)."""
        if task.id == 0 or not self.config.epochs:
            return []
        return [Phase(name, self.config.epochs, data="features", trainer=self.trainer_settings())]

    def trainer_settings(self) -> dict[str, Any]:
        """The alignment phase's own recipe: SGD, batches of drawn samples, a cosine stepped once an epoch (all five
        official copies step torch's CosineAnnealingLR per epoch), no warm-up, scaling or clipping."""
        c = self.config
        return {
            "optimizer": "sgd",
            "lr": c.lr,
            "momentum": c.momentum,
            "weight_decay": c.weight_decay,
            "batch_size": c.batch_size,
            "schedule": "cosine",
            "schedule_steps": "epoch",
            "cosine_epochs": c.cosine_epochs,
            "min_lr": 0.0,
            "warmup_epochs": 0.0,
            "lr_scale_batch": None,
            "grad_clip": None,
        }

    def param_groups(self, heads: nn.ModuleList) -> list[dict[str, Any]]:
        """Every head, every parameter decayed (biases too, as torch's SGD over ``fc.parameters()``)."""
        heads.requires_grad_(True)
        return [{"params": list(heads.parameters()), "weight_decay": self.config.weight_decay}]

    def keep(self, heads: nn.ModuleList) -> None:
        """Copy every head (before the alignment; SLCA's ``fc.backup()``)."""
        for copy, head in zip(self.copies, heads, strict=True):
            copy.keep(head)

    def restore(self, heads: nn.ModuleList) -> None:
        """Every head back to its kept copy (SLCA's ``fc.recall()``), where ``restore`` is on."""
        if self.config.restore:
            for copy, head in zip(self.copies, heads, strict=True):
                copy.restore(head)

    def shrink(self, tasks: list[Task], stage: int) -> torch.Tensor:
        """Each seen class's mean factor at ``stage`` (:func:`shrink_factors`)."""
        seen = tasks[: stage + 1]
        class_task = torch.cat([torch.full((t.num_classes,), t.id) for t in seen])
        return shrink_factors(
            torch.arange(len(class_task)), class_task, stage, seen[-1].num_classes, self.config.mean_shrink
        )

    @torch.no_grad()
    def draw(self, tasks: list[Task], stage: int, epoch: int) -> Split:
        """The samples of epoch ``epoch`` of the alignment at ``stage``: ``samples_per_class`` of every seen class (of
        every live cluster of it, with ``centroids`` > 1) in class order (global labels), or with ``steps=old``
        (``seen``) a random subset of one batch per old (seen) class."""
        c, seen = self.config, tasks[: stage + 1]
        device = self.tasks[0].mean.device
        generator = torch.Generator(device=device).manual_seed(draw_seed(stage, epoch))
        shrink = self.shrink(tasks, stage).to(device)
        n, parts, labels = c.samples_per_class, [], []
        for task, block in zip(seen, self.tasks, strict=True):
            classes = torch.arange(task.offset, task.offset + task.num_classes, device=device)
            if self.clustered:
                z = torch.randn(task.num_classes, c.centroids, n, self.dim, generator=generator, device=device)
                drawn = block.sample(z, shrink[classes])[block.live]  # (live clusters, n, D)
                classes = classes[:, None].expand(-1, c.centroids)[block.live]
            else:
                z = torch.randn(task.num_classes, n, self.dim, generator=generator, device=device)
                drawn = block.sample(z, shrink[classes])
            parts.append(drawn.flatten(0, 1))
            labels.append(classes.repeat_interleave(n))
        x, y = torch.cat(parts), torch.cat(labels)
        if c.steps != "all":
            batches = seen[-1].offset if c.steps == "old" else seen[-1].offset + seen[-1].num_classes
            kept = torch.randperm(len(y), generator=generator, device=device)[: batches * c.batch_size]
            x, y = x[kept], y[kept]
        return Split(x, y)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Cross-entropy over every seen class of the heads' fp32 logits on drawn features, SLCA-normalised with
        ``logit_norm`` (``sizes``: each seen task's number of classes)."""
        logits = logits.float()
        if self.config.logit_norm is not None:
            logits = logit_normalised(logits, sizes, self.config.logit_norm)
        return F.cross_entropy(logits, y)

    def storage_bits(self, task_id: int) -> dict[str, int]:
        """What task ``task_id``'s classes keep, in bits: 32-bit means and covariance factors (or deviations), and its
        head's pre-alignment copy."""
        block = self.tasks[task_id]
        bits = {"class_means": 32 * block.mean.numel(), "class_covariances": 32 * block.factor.numel()}
        if self.clustered:
            bits["cluster_sizes"] = 32 * block.size.numel()
        if self.config.restore and self.config.epochs:
            bits["head_copy"] = 32 * sum(b.numel() for b in self.copies[task_id].buffers())
        return bits
