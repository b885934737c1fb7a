"""An independent, plain-PyTorch transcription ("oracle") of EWC's rules, for use as a test reference.

Written from BASELINES.md §4 (Kirkpatrick et al. 2017; online EWC as GMvandeVen/continual-learning@e6d795a
models/cl/continual_learner.py reads Schwarz et al. 2018; mammoth@cb9a36d models/ewc_on.py), without reading
clbench's implementation. Small tensors, plain loops, float64.
"""

from __future__ import annotations

import torch


def softmax_probs(W: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> list[float]:
    """p_c = exp(z_c) / Σ_c' exp(z_c') of the linear model z = W x + b, one example, by a loop."""
    z = [sum(W[c, j].item() * x[j].item() for j in range(len(x))) + b[c].item() for c in range(W.shape[0])]
    top = max(z)
    e = [torch.tensor(v - top, dtype=torch.float64).exp().item() for v in z]
    return [v / sum(e) for v in e]


def linear_fisher(
    W: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: int, estimator: str, *, sampled: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form per-example Fisher of a linear softmax model (BASELINES §4.7), for W and b.

    g_c = ∇ log p_c: ∂/∂W[k, j] = (1[k=c] − p_k) x_j, ∂/∂b[k] = 1[k=c] − p_k. Then
    empirical (``true_label``): (1[k=y] − p_k)² x_j²; ``expected``: Σ_c p_c (1[k=c] − p_k)² x_j² = p_k (1 − p_k) x_j²;
    ``mammoth``: p_y (1[k=y] − p_k)² x_j²; ``sample`` with the drawn label ĉ = ``sampled``: (1[k=ĉ] − p_k)² x_j².
    """
    p = softmax_probs(W, b, x)
    C, D = W.shape
    FW = torch.zeros(C, D, dtype=torch.float64)
    Fb = torch.zeros(C, dtype=torch.float64)
    for k in range(C):
        if estimator == "expected":
            coef = p[k] * (1 - p[k])
        elif estimator == "true_label":
            coef = ((1.0 if k == y else 0.0) - p[k]) ** 2
        elif estimator == "mammoth":
            coef = p[y] * ((1.0 if k == y else 0.0) - p[k]) ** 2
        elif estimator == "sample":
            assert sampled is not None
            coef = ((1.0 if k == sampled else 0.0) - p[k]) ** 2
        else:
            raise ValueError(estimator)
        Fb[k] = coef
        for j in range(D):
            FW[k, j] = coef * x[j].item() ** 2
    return FW, Fb


def online_merge(fishers: list[torch.Tensor], gamma: float) -> torch.Tensor:
    """F̃_1 = F_1, F̃_t = γ F̃_{t−1} + F_t."""
    merged = None
    for f in fishers:
        merged = f.clone() if merged is None else gamma * merged + f
    assert merged is not None
    return merged


def offline_penalty(
    theta: list[torch.Tensor], per_task: list[tuple[list[torch.Tensor], list[torch.Tensor]]], lam: float, half: bool
) -> float:
    """s λ Σ_k Σ_i F_{k,i} (θ_i − θ*_{k,i})² over every stored (F_k, θ*_k), s = ½ with ``half``; each entry of
    ``per_task`` is (the task's Fishers, its anchors), one tensor per parameter, aligned with ``theta``."""
    s = 0.5 if half else 1.0
    total = 0.0
    for fishers, anchors in per_task:
        for th, f, a in zip(theta, fishers, anchors, strict=True):
            for i in range(th.numel()):
                total += f.reshape(-1)[i].item() * (th.reshape(-1)[i].item() - a.reshape(-1)[i].item()) ** 2
    return s * lam * total


def online_penalty(
    theta: list[torch.Tensor],
    merged: list[torch.Tensor],
    anchor: list[torch.Tensor],
    *,
    lam: float,
    gamma: float,
    half: bool,
    gamma_on_read: bool = True,
) -> float:
    """Online EWC's penalty s λ γ Σ_i F̃_i (θ_i − θ*_i)² (GMvandeVen: γ applied again when read); mammoth's
    convention is ``half=False, gamma_on_read=False``: λ Σ F̃ (θ − θ*)²."""
    s = 0.5 if half else 1.0
    g = gamma if gamma_on_read else 1.0
    total = 0.0
    for th, f, a in zip(theta, merged, anchor, strict=True):
        for i in range(th.numel()):
            total += f.reshape(-1)[i].item() * (th.reshape(-1)[i].item() - a.reshape(-1)[i].item()) ** 2
    return s * lam * g * total
