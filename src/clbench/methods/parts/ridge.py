"""A ridge (analytic) head over random ReLU features, from fp64 statistics: RanPAC's (McDonnell et al., NeurIPS 2023;
RanPAC/RanPAC@012927f RanPAC.py ``setup_RP`` L246-260, ``replace_fc`` L91-136, ``optimise_ridge_parameter``
L138-150) and MIN's (Jiang et al., NeurIPS 2025; MIN's code's ``RandomBuffer`` and recursive least squares, which the
same statistics solve exactly: :class:`PassStatistics`).

Features h = ReLU(phi W) with W in R^{d x M} drawn once, entries N(0, 1) (:func:`random_projection`, from a seed, so
it is stored as the seed). Over everything seen the head keeps G = sum h^T h (M x M) and Q = sum h^T y (M x C, y one-hot
over every class) and answers W_o = ((G + lambda I)^{-1} Q)^T by a linear solve, not an inverse (the code's
``torch.linalg.solve``); the statistics are fp64 (the code's fp32 normal equations are ill-conditioned at
lambda = 1e-8). Every statistic is a sum, so the ranks of a multi-process run add theirs up.

lambda is chosen per task from 10^-8 .. 10^8 (:data:`RIDGES`) on that task's data alone: its rows in a seeded order,
the first int(0.8 n) fit (G_fit, Q_fit), the rest held out; the held-out rows' mean squared error over every class
column decides (the first of equal ones). The code's order is its shuffled loader's; here a permutation drawn from a
seed (:class:`HoldoutStatistics`), so a run can be repeated and resumed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from clbench.data import Task

RIDGES = tuple(10.0**e for e in range(-8, 9))  # optimise_ridge_parameter: 10.0 ** np.arange(-8, 9)


def random_projection(dim: int, size: int, seed: int) -> torch.Tensor:
    """W in R^{dim x size}, entries N(0, 1) (``torch.randn``, no scaling), drawn on the CPU from ``seed`` alone: the
    same on every device and every time."""
    return torch.randn(dim, size, generator=torch.Generator().manual_seed(seed))


def relu_features(feats: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """h = ReLU(phi W) in fp32 whatever the autocast around it."""
    with torch.autocast(feats.device.type, enabled=False):
        return F.relu(feats.float() @ projection.float())


def ridge_head(width: int, classes: int, device: torch.device) -> nn.Linear:
    """A task's rows of the head over ``width`` features: filled by the solve, never trained; zero until then (an
    unsolved head adds nothing to the logits: MIN's first task trains on its auxiliary head alone; the loop's
    measurements before a task, FWT's b_j, see ties, so an unsolved task scores its first class), the bias always."""
    head = nn.Linear(width, classes, device=device).requires_grad_(False)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def ridge_logits(feats: torch.Tensor, head: nn.Linear) -> torch.Tensor:
    """h · W_o[c] in fp32 whatever the autocast: a ridge solution's weights can be large and cancel, which bf16's 8
    bits would not keep."""
    with torch.autocast(feats.device.type, enabled=False):
        return F.linear(feats.float(), head.weight, head.bias)


def ridge_solve(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> torch.Tensor:
    """(G + lambda I)^{-1} Q by a linear solve (LU), in the statistics' precision."""
    system = gram.clone()
    system.diagonal().add_(ridge)
    return torch.linalg.solve(system, cross)


def select_ridge(
    gram: torch.Tensor, cross: torch.Tensor, held: torch.Tensor, targets: torch.Tensor, ridges: tuple[float, ...]
) -> tuple[float, list[float]]:
    """The lambda of ``ridges`` whose fit on (G_fit, Q_fit) has the lowest mean squared error on the held-out rows
    ``held`` (n x M) against their one-hot ``targets`` (n x C), the first of equal ones; and every lambda's error (all 0
    without held-out rows, where the first lambda is taken)."""
    losses = []
    for ridge in ridges:
        if len(held):
            losses.append(float(F.mse_loss(held @ ridge_solve(gram, cross, ridge), targets)))
        else:
            losses.append(0.0)
    return ridges[min(range(len(losses)), key=losses.__getitem__)], losses


class RidgeStatistics(nn.Module):
    """G (M x M) and Q (M x C) in fp64 over everything observed, kept where the method is (on the device: each batch
    adds its Gram matrix at GEMM speed), allocated at the first :meth:`allocate` (a checkpoint written before holds
    neither). A checkpoint that holds them loads into statistics not yet allocated (a replay that observed nothing):
    they are allocated on ``device`` first."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device
        self.register_buffer("gram", None)
        self.register_buffer("cross", None)
        self.register_load_state_dict_pre_hook(RidgeStatistics.allocate_for)

    def allocate(self, size: int, classes: int, device: torch.device) -> None:
        if self.gram is None:
            self.gram = torch.zeros(size, size, dtype=torch.float64, device=device)
            self.cross = torch.zeros(size, classes, dtype=torch.float64, device=device)

    def allocate_for(self, state: dict[str, torch.Tensor], prefix: str, *_: object) -> None:
        """Before a state dict is loaded: the shapes of the G and Q it holds."""
        gram, cross = state.get(prefix + "gram"), state.get(prefix + "cross")
        if gram is not None and cross is not None:
            self.allocate(gram.shape[0], cross.shape[1], self.device or gram.device)

    @torch.no_grad()
    def solve(self, ridge: float, classes: int) -> torch.Tensor:
        """The head W_o (classes x M, fp32) of the first ``classes`` classes: ((G + lambda I)^{-1} Q)^T. Classes not
        seen yet have zero columns in Q, so solving for the seen ones alone is exact."""
        assert self.gram is not None and self.cross is not None
        return ridge_solve(self.gram, self.cross[:, :classes], ridge).T.float()

    @torch.no_grad()
    def write_heads(self, ridge: float, heads: nn.ModuleList, tasks: list[Task]) -> None:
        """W_o of every class of the tasks that have a head, written into each one's rows: old classes' rows change
        whenever the statistics do."""
        seen = tasks[: len(heads)]
        weights = self.solve(ridge, sum(t.num_classes for t in seen))
        for task in seen:
            heads[task.id].weight.copy_(weights[task.offset : task.offset + task.num_classes])


class PassStatistics:
    """One observe pass's G and Q and its row count, kept apart from the running :class:`RidgeStatistics` until the
    ranks have added theirs up (a sum over ranks of the running ones would count them once per rank), then folded in.

    Adding every batch's h^T h and h^T y is the recursive least squares of MIN's code (``MiNbaseNet.fit``: K = (I +
    X R X^T)^-1, R <- R - R X^T K X R, W <- W + R X^T (Y - X W), R_0 = I / gamma) in closed form: after any sequence of
    batches its W is (sum X^T X + gamma I)^-1 sum X^T Y, what :meth:`RidgeStatistics.solve` returns."""

    def __init__(self, size: int, classes: int, device: torch.device) -> None:
        f64 = {"dtype": torch.float64, "device": device}
        self.gram = torch.zeros(size, size, **f64)
        self.cross = torch.zeros(size, classes, **f64)
        self.count = torch.zeros((), dtype=torch.long, device=device)

    @torch.no_grad()
    def observe(self, h: torch.Tensor, y: torch.Tensor) -> None:
        """Add a batch's features ``h`` (B x M) and global labels ``y``."""
        h = h.double()
        self.gram.addmm_(h.T, h)
        self.cross.addmm_(h.T, F.one_hot(y, self.cross.shape[1]).double())
        self.count += len(y)

    def sums(self) -> list[torch.Tensor]:
        """What the ranks add up."""
        return [self.gram, self.cross, self.count]

    @torch.no_grad()
    def fold_into(self, stats: RidgeStatistics) -> None:
        assert stats.gram is not None and stats.cross is not None
        stats.gram.add_(self.gram)
        stats.cross.add_(self.cross)


class HoldoutStatistics:
    """One task's statistics while it is observed: G_fit, Q_fit of its fitting rows and the held-out rows themselves,
    as sums (a held-out row is added at its own index, so the ranks' sums put every row in place).

    The task's ``rows`` rows are ranked by a permutation drawn from ``seed``; the first int(0.8 n) (``fit`` of n) fit,
    the others are held out. A row is told apart by its position in the task's data (:meth:`Method.observe`'s
    ``rows``)."""

    def __init__(self, size: int, classes: int, rows: int, *, fit: float, seed: int, device: torch.device) -> None:
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        self.rank = torch.empty(rows, dtype=torch.long)
        self.rank[order] = torch.arange(rows)
        self.rank = self.rank.to(device)
        self.fitting = int(rows * fit)  # the code: int(Features.shape[0] * 0.8)
        self.classes = classes
        f64 = {"dtype": torch.float64, "device": device}
        self.gram = torch.zeros(size, size, **f64)
        self.cross = torch.zeros(size, classes, **f64)
        self.held = torch.zeros(rows - self.fitting, size, **f64)
        self.held_labels = torch.zeros(rows - self.fitting, dtype=torch.long, device=device)  # label + 1, 0: none
        self.count = torch.zeros((), dtype=torch.long, device=device)

    @torch.no_grad()
    def observe(self, h: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> None:
        """Add a batch's features ``h`` (B x M), global labels ``y`` and positions ``rows``."""
        rank = self.rank[rows]
        fits = (rank < self.fitting).unsqueeze(1)
        h = h.double()
        fitting = h * fits
        self.gram.addmm_(fitting.T, fitting)
        self.cross.addmm_(fitting.T, F.one_hot(y, self.classes).double())
        index = (rank - self.fitting).clamp(min=0)
        self.held.index_add_(0, index, h * ~fits)
        self.held_labels.index_add_(0, index, (y + 1) * ~fits.squeeze(1))
        self.count += len(y)

    def sums(self) -> list[torch.Tensor]:
        """What the ranks add up."""
        return [self.gram, self.cross, self.held, self.held_labels, self.count]

    def targets(self) -> torch.Tensor:
        """The held-out rows' one-hot labels over every class."""
        return F.one_hot(self.held_labels - 1, self.classes).double()

    @torch.no_grad()
    def fold_into(self, stats: RidgeStatistics) -> None:
        """Add the whole task, its fitting rows and its held-out ones, to the running G and Q (in place)."""
        assert stats.gram is not None and stats.cross is not None
        stats.gram.add_(self.gram).addmm_(self.held.T, self.held)
        stats.cross.add_(self.cross).addmm_(self.held.T, self.targets())
