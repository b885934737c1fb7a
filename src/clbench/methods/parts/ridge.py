"""A ridge (analytic) head over random ReLU features, from fp64 statistics: RanPAC's (McDonnell et al., NeurIPS 2023;
RanPAC/RanPAC@012927f RanPAC.py ``setup_RP`` L246-260, ``replace_fc`` L91-136, ``optimise_ridge_parameter``
L138-150).

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

import torch
import torch.nn.functional as F
from torch import nn

RIDGES = tuple(10.0**e for e in range(-8, 9))  # optimise_ridge_parameter: 10.0 ** np.arange(-8, 9)


def random_projection(dim: int, size: int, seed: int) -> torch.Tensor:
    """W in R^{dim x size}, entries N(0, 1) (``torch.randn``, no scaling), drawn on the CPU from ``seed`` alone: the
    same on every device and every time."""
    return torch.randn(dim, size, generator=torch.Generator().manual_seed(seed))


def relu_features(feats: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """h = ReLU(phi W) in fp32 whatever the autocast around it."""
    with torch.autocast(feats.device.type, enabled=False):
        return F.relu(feats.float() @ projection.float())


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
    neither)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gram", None)
        self.register_buffer("cross", None)

    def allocate(self, size: int, classes: int, device: torch.device) -> None:
        if self.gram is None:
            self.gram = torch.zeros(size, size, dtype=torch.float64, device=device)
            self.cross = torch.zeros(size, classes, dtype=torch.float64, device=device)

    @torch.no_grad()
    def solve(self, ridge: float, classes: int) -> torch.Tensor:
        """The head W_o (classes x M, fp32) of the first ``classes`` classes: ((G + lambda I)^{-1} Q)^T. Classes not
        seen yet have zero columns in Q, so solving for the seen ones alone is exact."""
        assert self.gram is not None and self.cross is not None
        return ridge_solve(self.gram, self.cross[:, :classes], ridge).T.float()


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
