"""Independent transcriptions of GDumb's sampler and BiC's losses from BASELINES.md §2.2b, §2.2d, §8.4, §9.1, §9.5, in
plain Python/torch loops, written from the text alone (not from clbench's implementation)."""

from __future__ import annotations

import math

import torch


def greedy_reachable_counts(labels: list[int], k: int) -> list[set[tuple[tuple[int, int], ...]]]:
    """GDumb's streaming greedy sampler (§2.2b, RaptorMai's transcription with the paper's random ties): for each
    (x, y) in order, k_c = ⌊k / max(1, |C_M|)⌋ with C_M the classes currently in memory; if y ∉ C_M or count(y) < k_c:
    when the memory is full, remove a sample of a class with the largest count (ties: any of them), then add y;
    otherwise drop it. Returns, after each item, every per-class count state reachable (as sorted (class, count)
    pairs of the classes held), branching over the ties."""
    states: set[tuple[tuple[int, int], ...]] = {()}
    out = []
    for y in labels:
        nxt = set()
        for state in states:
            counts = dict(state)
            k_c = k // max(1, len(counts))
            if y in counts and counts[y] >= k_c:
                nxt.add(state)
                continue
            if sum(counts.values()) >= k:
                most = max(counts.values())
                for c in [c for c, n in counts.items() if n == most]:
                    after = dict(counts)
                    after[c] -= 1
                    if after[c] == 0:
                        del after[c]
                    after[y] = after.get(y, 0) + 1
                    nxt.add(tuple(sorted(after.items())))
            else:
                after = dict(counts)
                after[y] = after.get(y, 0) + 1
                nxt.add(tuple(sorted(after.items())))
        states = nxt
        out.append(states)
    return out


def offline_per_class(k: int, num_classes: int) -> int:
    """The offline end state (§8.4): ⌊k / #classes⌋ images of each class."""
    return k // num_classes


def herding_reference(features: list[list[float]], k: int) -> list[int]:
    """iCaRL herding (§2.2d): repeatedly add the example (not yet chosen) that brings the running mean of the chosen
    features closest (L2) to the mean of all features; ties to the lowest index."""
    n, d = len(features), len(features[0])
    mu = [sum(f[j] for f in features) / n for j in range(d)]
    chosen: list[int] = []
    total = [0.0] * d
    for i in range(1, k + 1):
        best, best_dist = -1, math.inf
        for r in range(n):
            if r in chosen:
                continue
            dist = math.sqrt(sum((mu[j] - (total[j] + features[r][j]) / i) ** 2 for j in range(d)))
            if dist < best_dist:
                best, best_dist = r, dist
        chosen.append(best)
        total = [total[j] + features[best][j] for j in range(d)]
    return chosen


def bic_lambda(n_old: int, m_new: int) -> float:
    """λ = n / (n + m) (§9.1)."""
    return n_old / (n_old + m_new)


def bic_stage1_loss(
    student: torch.Tensor,
    teacher_old: torch.Tensor,
    y: torch.Tensor,
    *,
    teacher_newest_start: int,
    beta: float,
    gamma: float,
    T: float = 2.0,
) -> torch.Tensor:
    """L = λ L_d + (1 − λ) L_c (§9.1): ``student`` logits over every seen class (n old first), ``teacher_old`` the
    teacher's raw logits over the n old classes, whose columns from ``teacher_newest_start`` on (its newest task) are
    first mapped to β·o + γ. L_c = CE over the seen classes; L_d = CE between softmax(ô/T) and softmax(o_old/T), no
    T², averaged over the batch."""
    n = teacher_old.shape[1]
    m = student.shape[1] - n
    corrected = teacher_old.clone().double()
    corrected[:, teacher_newest_start:] = beta * corrected[:, teacher_newest_start:] + gamma
    s = student.double()
    rows = []
    for i in range(len(y)):
        p_t = torch.softmax(corrected[i] / T, dim=0)
        log_p_s = torch.log_softmax(s[i, :n] / T, dim=0)
        rows.append(-(p_t * log_p_s).sum())
    l_d = torch.stack(rows).mean()
    l_c = torch.stack([-torch.log_softmax(s[i], dim=0)[y[i]] for i in range(len(y))]).mean()
    lam = bic_lambda(n, m)
    return lam * l_d + (1 - lam) * l_c


def bias_layer(logits: torch.Tensor, newest_start: int, beta: float, gamma: float) -> torch.Tensor:
    """q = β·o + γ on the newest classes' columns, the others unchanged (§9.1)."""
    out = logits.clone()
    out[:, newest_start:] = beta * logits[:, newest_start:] + gamma
    return out


def bias_stage_loss(logits: torch.Tensor, y: torch.Tensor, newest_start: int, beta: float, gamma: float) -> float:
    """Stage 2 (§9.1): CE over every seen class of the bias-corrected logits + 0.1·γ²/2 (§14: 0.05γ²)."""
    q = bias_layer(logits.double(), newest_start, beta, gamma)
    ce = sum(-torch.log_softmax(q[i], dim=0)[y[i]].item() for i in range(len(y))) / len(y)
    return ce + 0.05 * gamma**2
