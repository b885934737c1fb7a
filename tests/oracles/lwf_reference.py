"""An independent, plain-PyTorch transcription ("oracle") of LwF's distillation rules, for use as a test reference.

Written from BASELINES.md §5 (official lizhitwo/LearningWithoutForgetting@795176d vl_nnsoftmaxdiff.m: the recorded
probabilities raised to 1/T and renormalised; mammoth@cb9a36d models/lwf.py ``smooth``; PackNet/HAT per-old-head sums,
FACIL one softmax over the concatenated old heads), without reading clbench's implementation. Plain loops, float64.
"""

from __future__ import annotations

import math


def softmax(z: list[float]) -> list[float]:
    top = max(z)
    e = [math.exp(v - top) for v in z]
    return [v / sum(e) for v in e]


def smooth(p: list[float], T: float) -> list[float]:
    """mammoth's / the official code's target: p^{1/T} renormalised."""
    q = [v ** (1.0 / T) for v in p]
    return [v / sum(q) for v in q]


def kd_row(z: list[float], z_old: list[float], T: float) -> float:
    """−Σ_c y'_c log ŷ'_c with y' = smooth(softmax(z_old), T) and ŷ' = smooth(softmax(z), T) (no T²)."""
    target = smooth(softmax(z_old), T)
    student = smooth(softmax(z), T)
    return -sum(t * math.log(s) for t, s in zip(target, student, strict=True))


def kd_grad_row(z: list[float], z_old: list[float], T: float) -> list[float]:
    """∂ kd_row / ∂z = (softmax(z/T) − softmax(z_old/T)) / T."""
    ps = softmax([v / T for v in z])
    pt = softmax([v / T for v in z_old])
    return [(a - b) / T for a, b in zip(ps, pt, strict=True)]


def lwf_kd(
    student_heads: list[list[list[float]]], teacher_heads: list[list[list[float]]], T: float, scope: str
) -> float:
    """The batch-mean KD over old heads: ``til`` = Σ over old heads of per-head KD; ``cil`` = one KD over the
    concatenated old heads. ``*_heads[k][i]`` is head k's logits for row i."""
    rows = len(student_heads[0])
    total = 0.0
    for i in range(rows):
        if scope == "til":
            for s, t in zip(student_heads, teacher_heads, strict=True):
                total += kd_row(s[i], t[i], T)
        else:
            z = [v for head in student_heads for v in head[i]]
            z_old = [v for head in teacher_heads for v in head[i]]
            total += kd_row(z, z_old, T)
    return total / rows


def entropy(p: list[float]) -> float:
    return -sum(v * math.log(v) for v in p if v > 0)
