"""DualGPM: per layer, the subspace spanned by the earlier tasks' inputs, kept as an orthonormal basis of it
("remove") or, once that is the smaller, of its complement ("retain"), grown after every task by an energy threshold;
as InfLoRA's code keeps it (liangyanshuo/InfLoRA@e08b00e methods/inflora.py ``update_DualGPM`` L321-412) and designs
each task's LoRA down-projection from it (``_train`` L116-158). The rule descends from GPM (Saha et al., ICLR 2021).

A task's input to a layer is summarised by its second moment M = (1/n) Σ x x^T over every token (d x d); s_j are the
singular values of M (the code squares them, so its energies are fourth powers of the inputs' singular values: kept).

- First task: k = #{j : Σ_{i<=j} s_i^2 / Σ s^2 < ε} (at least 1), basis = the first k left singular vectors of M.
- Later tasks, "remove" (basis U of the old subspace): the energy already covered is (Σ s^2 − Σ ŝ^2) / Σ s^2, ŝ the
  singular values of M̂ = M − U U^T M; the leading left singular vectors of M̂ are appended while that energy, plus
  each one's ŝ_j^2 / Σ s^2, is below ε.
- "retain" (basis U of the complement): M̂ = U U^T M, the energy left free is Σ ŝ^2 / Σ s^2; while it is at least
  1 − ε the leading singular vector of M̂ leaves the complement (the remaining basis is the leading left singular
  vectors of U − Û Û^T U, k − r of them).
- After the update a "remove" basis of more than d/2 vectors is replaced by its complement and becomes "retain".

ε_t = λ_b + (λ_e − λ_b) t / T at task t of T. Everything is fp64 here (the code: fp32 NumPy).

Designing task t's A (r x d): the first r left singular vectors of the part of M the old subspace leaves free
(M − P M for "remove", P M for "retain", P = U U^T; M itself at the first task), transposed and scaled.
"""

from __future__ import annotations

import torch
from torch import nn


def energy_threshold(task: int, tasks: int, lamb: float, lame: float) -> float:
    """ε_t = (λ_e − λ_b) t / T + λ_b (``threshold``, L322)."""
    return (lame - lamb) * task / tasks + lamb


def singular(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left singular vectors and singular values (thin SVD)."""
    u, s, _ = torch.linalg.svd(matrix, full_matrices=False)
    return u, s


class Subspace(nn.Module):
    """One layer's DualGPM: ``basis[:, :size]`` spans the old inputs (``retain`` False) or their complement (True);
    size 0 before the first task. Stored in a d x d fp64 buffer so that its shape never changes."""

    def __init__(self, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.register_buffer("basis", torch.zeros(dim, dim, dtype=torch.float64, device=device))
        self.register_buffer("size", torch.zeros((), dtype=torch.long, device=device))
        self.register_buffer("retain", torch.zeros((), dtype=torch.bool, device=device))

    @property
    def dim(self) -> int:
        return self.basis.shape[0]

    def vectors(self) -> torch.Tensor:
        return self.basis[:, : int(self.size)]

    def free(self, moment: torch.Tensor) -> torch.Tensor:
        """The part of ``moment`` outside the old subspace: M − P M ("remove"), P M ("retain"), M (empty)."""
        if not int(self.size):
            return moment
        u = self.vectors()
        projected = u @ (u.T @ moment)
        return projected if bool(self.retain) else moment - projected

    def design(self, moment: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
        """A = scale · (the first ``rank`` left singular vectors of the free part of ``moment``)^T, (rank x d)."""
        u, _ = singular(self.free(moment.double()))
        return scale * u[:, :rank].T

    @torch.no_grad()
    def update(self, moment: torch.Tensor, threshold: float) -> None:
        """Grow the subspace with a task's input moment (``update_DualGPM``), then switch to its complement if the
        basis exceeds d/2."""
        moment = moment.double()
        u = self.vectors()
        if not u.shape[1]:
            left, s = singular(moment)
            ratio = s**2 / (s**2).sum()
            k = max(int((torch.cumsum(ratio, 0) < threshold).sum()), 1)
            basis = left[:, :k]
        else:
            _, s = singular(moment)
            total = (s**2).sum()
            left, s_free = singular(self.free(moment))
            ratio = (s_free**2 / total).tolist()
            if bool(self.retain):
                covered, r = float((s_free**2).sum() / total), 0
                while r < min(len(ratio), u.shape[1]) and covered >= 1 - threshold:
                    covered -= ratio[r]
                    r += 1
                leave = left[:, :r]
                basis = torch.linalg.svd(u - leave @ (leave.T @ u))[0][:, : u.shape[1] - r] if r else u
            else:
                covered, r = float((total - (s_free**2).sum()) / total), 0
                while r < len(ratio) and covered < threshold:
                    covered += ratio[r]
                    r += 1
                basis = torch.cat([u, left[:, :r]], dim=1)[:, : self.dim]
        retain = bool(self.retain)
        if not retain and basis.shape[1] > self.dim / 2:
            basis, retain = torch.linalg.svd(basis)[0][:, basis.shape[1] :], True
        self.basis.zero_()
        self.basis[:, : basis.shape[1]] = basis
        self.size.fill_(basis.shape[1])
        self.retain.fill_(retain)
