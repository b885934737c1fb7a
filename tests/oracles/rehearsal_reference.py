"""An independent, plain-Python transcription ("oracle") of the rehearsal baselines' rules, for use as a test reference.

Written from BASELINES.md §2.2(a) (mammoth@cb9a36d utils/buffer.py reservoir: one item at a time, slot n while n < M,
else j = randint(0, n + 1) kept when j < M), §2.3 / §6.1 (ER: one CE, mean over the B + M concatenated rows) and §7.1 /
§7.5 (DER++: CE(current) + alpha * MSE(stored logits over their valid width, mean over the valid entries) + beta *
CE(second draw)), without reading clbench's implementation. Plain lists, loops and ``math``.
"""

from __future__ import annotations

import math


def reservoir(slots: list, seen: int, items: list, uniforms: list[float]) -> tuple[list, int]:
    """Offer ``items`` one at a time to a reservoir of ``len(slots)`` slots that has seen ``seen`` examples so far.

    Item i (stream position n = seen + i) goes to slot n while n < M; otherwise j = floor(u_i * (n + 1)), a uniform
    integer in {0, ..., n} (mammoth: ``np.random.randint(0, n + 1)``), and the item overwrites slot j when j < M, else
    it is dropped. Items are applied in order, so a later item of the batch that draws the same slot wins.
    Returns the new slot list (a copy) and the new count."""
    capacity = len(slots)
    out = list(slots)
    n = seen
    for item, u in zip(items, uniforms, strict=True):
        if n < capacity:
            out[n] = item
        else:
            j = math.floor(u * (n + 1))
            if j < capacity:
                out[j] = item
        n += 1
    return out, n


def reservoir_targets(seen: int, capacity: int, uniforms: list[float]) -> list[int | None]:
    """The slot each item of a batch is written to (None: dropped), before the later-wins resolution."""
    targets: list[int | None] = []
    for i, u in enumerate(uniforms):
        n = seen + i
        if n < capacity:
            targets.append(n)
        else:
            j = math.floor(u * (n + 1))
            targets.append(j if j < capacity else None)
    return targets


def log_softmax(z: list[float]) -> list[float]:
    top = max(z)
    lse = top + math.log(sum(math.exp(v - top) for v in z))
    return [v - lse for v in z]


def cross_entropy_rows(logits: list[list[float]], labels: list[int]) -> list[float]:
    """Per-row CE: -log softmax(z)_y."""
    return [-log_softmax(z)[y] for z, y in zip(logits, labels, strict=True)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def er_loss(
    current_logits: list[list[float]],
    current_labels: list[int],
    memory_logits: list[list[float]],
    memory_labels: list[int],
) -> float:
    """ER (§6.1): the current B rows and the M memory rows concatenated, one CE, mean over the B + M rows."""
    rows = cross_entropy_rows(current_logits + memory_logits, current_labels + memory_labels)
    return sum(rows) / len(rows)


def er_mean_of_means(
    current_logits: list[list[float]],
    current_labels: list[int],
    memory_logits: list[list[float]],
    memory_labels: list[int],
) -> float:
    """What ER is NOT: the average of the current-batch mean and the memory-batch mean."""
    a = mean(cross_entropy_rows(current_logits, current_labels))
    b = mean(cross_entropy_rows(memory_logits, memory_labels))
    return (a + b) / 2


def masked_mse(outputs: list[list[float]], stored: list[list[float]], widths: list[int]) -> float:
    """§7.5 as clbench fixes it: the squared error over each row's valid width only (the first w_i columns), each
    row's mean over its w_i entries, then the mean over the rows (mammoth's mean over M x C entries where all rows
    have one width; §7.5's "divided by sum_i w_i" weighs wide rows more and does not average exactly over DDP ranks).
    Columns past w_i (padding) never enter."""
    per_row = []
    for f, z, w in zip(outputs, stored, widths, strict=True):
        per_row.append(sum((f[c] - z[c]) ** 2 for c in range(w)) / w)
    return sum(per_row) / len(per_row)


def derpp_loss(
    current_logits: list[list[float]],
    current_labels: list[int],
    *,
    draw1_logits: list[list[float]],
    draw1_stored: list[list[float]],
    draw1_widths: list[int],
    draw2_logits: list[list[float]],
    draw2_labels: list[int],
    alpha: float,
    beta: float,
) -> float:
    """DER++ (§7.1): CE(current) + alpha * MSE(f(x'_1), z_1) over valid widths + beta * CE(f(x'_2), y_2); every CE is
    the mean over its rows. beta = 0 is DER."""
    ce = mean(cross_entropy_rows(current_logits, current_labels))
    mse = masked_mse(draw1_logits, draw1_stored, draw1_widths)
    ce2 = mean(cross_entropy_rows(draw2_logits, draw2_labels))
    return ce + alpha * mse + beta * ce2
