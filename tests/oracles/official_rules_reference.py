"""Independent transcriptions ("oracles") of the rules the seed tables' official codes compute where clbench's
presets name them, written from the codes (not from clbench's implementation), on small tensors:

- the L2P code's one head over every class with its train mask (google-research/l2p@dd8836e train_continual.py
  L271-288): the current rows' logits outside the current task at -inf; with replay (``replay_no_mask``) the replayed
  rows keep every class; one mean cross-entropy over all rows; every column of the head trains. ER and DER++ under the
  L2P Table 1 presets follow it over the seen classes; L2P-R over every class of the benchmark.
- L2P's replay (train_continual.py L747-760, libml/continual_buffer.py): replay only from the second task; the buffer
  holds the (augmented) batch image as the step saw it.
- BiC's exemplar management (wuyuebupt/LargeScaleIncrementalLearning@7f687a3 imagenet_main.py L439-535): with K
  images in all and n_old old classes, the bias stage's validation takes floor(0.1 K / n_old) images of every class
  (old and new); after the step every seen class keeps ceil(K / n) - ceil(0.1 K / n) exemplars, chosen by herding on
  the new model's features among the class's images of the step's training set (the old classes' current exemplars).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------------------------------ the L2P code's one head
def l2p_code_loss(
    logits: torch.Tensor, y: torch.Tensor, current: int, task_classes: tuple[int, int], replay_no_mask: bool = True
) -> torch.Tensor:
    """train_continual.py L271-288: ``logits`` (rows, classes of the head) of the batch and its replayed rows (the
    first ``current`` rows are the batch); the batch's logits outside ``task_classes`` = [lo, hi) set to -inf (with
    ``replay_no_mask`` only the batch's, else every row's); the mean cross-entropy over every row."""
    lo, hi = task_classes
    outside = torch.ones(logits.shape[1], dtype=torch.bool)
    outside[lo:hi] = False
    masked = logits.clone()
    rows = slice(0, current) if replay_no_mask else slice(None)
    masked[rows, outside] = -math.inf
    return F.cross_entropy(masked, y)


def per_row_mse(outputs: torch.Tensor, stored: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """DER++'s logit term over each stored row's width (the classes seen when it was stored), each row's mean, then
    the mean over the rows."""
    rows = [((outputs[i, :w] - stored[i, :w]) ** 2).mean() for i, w in enumerate(widths.tolist())]
    return torch.stack(rows).mean()


def sgd_step(params: list[torch.Tensor], loss: torch.Tensor, lr: float) -> list[torch.Tensor]:
    """Plain SGD (no momentum, no weight decay): p - lr * dloss/dp for every tensor."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [p.detach() - lr * (g if g is not None else torch.zeros_like(p)) for p, g in zip(params, grads, strict=True)]


# ---------------------------------------------------------------------------------------------- L2P's replay buffer
def l2p_replays(task_id: int) -> bool:
    """train_continual.py L752: ``if replay_buffer and (task_id > 0)``: replay from the second task on."""
    return task_id > 0


# ------------------------------------------------------------------------------------------------------------ BiC
def bic_validation_per_class(total: int, old_classes: int) -> int:
    """imagenet_main.py L439: nb_val_itera = floor(nb_val x nb_groups x nb_proto / itera) = floor(0.1 K / n_old) (K =
    nb_proto x nb_groups x nb_cl, n_old = itera x nb_cl), for every class of the step, old and new."""
    return total // (10 * old_classes)


def bic_exemplars_per_class(total: int, classes: int) -> int:
    """imagenet_main.py L488-489: after the step, ceil(K / n) - ceil(0.1 K / n) exemplars of each of its n classes."""
    return -(-total // classes) - (-(-total // (10 * classes)))


def herding_order(features: torch.Tensor, k: int) -> list[int]:
    """imagenet_main.py L506-527: k times, the not-yet-chosen row whose feature f minimises
    || mu - f / (k + 1) - sum(chosen) / (k + 1) || (mu the mean of all rows); ties to the first row."""
    mu = features.double().mean(0)
    chosen: list[int] = []
    for step in range(k):
        others = sum((features[j].double() / (step + 1) for j in chosen), torch.zeros_like(mu))
        best, best_dist = -1, math.inf
        for r in range(len(features)):
            if r in chosen:
                continue
            dist = float((mu - features[r].double() / (step + 1) - others).norm())
            if dist < best_dist:
                best, best_dist = r, dist
        chosen.append(best)
    return chosen
