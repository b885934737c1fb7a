"""An independent, plain-PyTorch reference ("oracle") of RanPAC's Phase 2, transcribed from the official code
RanPAC/RanPAC@012927f (RanPAC.py ``setup_RP`` L246-260, ``replace_fc`` L91-136, ``optimise_ridge_parameter``
L138-150; inc_net.py ``CosineLinear.forward`` L29-46 with ``use_RP``; utils/toolkit.py ``target2onehot``). No clbench
code. The code runs it in fp32 on the CPU; the functions here take whatever dtype they are given.

Per task, on the task's features in loader order (Features_f, labels)::

    H = ReLU(Features_f @ W_rand)                  (H = Features_f when M = 0)
    Q = Q + H^T Y;  G = G + H^T H                  (Y one-hot over all the dataset's classes)
    ridge = optimise_ridge_parameter(H, Y)         (the first 80% of the rows fit, the last 20% score)
    Wo = solve(G + ridge I, Q)^T;  fc.weight = Wo[:classes seen]
    logits = sigma · (ReLU(x @ W_rand) @ fc.weight^T)   (sigma of a fresh head: 1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RIDGES = [10.0**e for e in range(-8, 9)]  # 10.0 ** np.arange(-8, 9)


def target2onehot(targets: torch.Tensor, n_classes: int) -> torch.Tensor:
    onehot = torch.zeros(targets.shape[0], n_classes, dtype=torch.float64)
    onehot.scatter_(dim=1, index=targets.long().view(-1, 1), value=1.0)
    return onehot


def optimise_ridge_parameter(features: torch.Tensor, y: torch.Tensor) -> tuple[float, list[float]]:
    """The ridge with the lowest MSE on the last 20% of the rows when fitted on the first 80% (np.argmin: the first
    of equal ones), and every ridge's MSE."""
    num_val_samples = int(features.shape[0] * 0.8)
    losses = []
    q_val = features[0:num_val_samples, :].T @ y[0:num_val_samples, :]
    g_val = features[0:num_val_samples, :].T @ features[0:num_val_samples, :]
    for ridge in RIDGES:
        wo = torch.linalg.solve(g_val + ridge * torch.eye(g_val.size(dim=0), dtype=g_val.dtype), q_val).T
        y_train_pred = features[num_val_samples::, :] @ wo.T
        losses.append(float(F.mse_loss(y_train_pred, y[num_val_samples::, :])))
    best = min(range(len(losses)), key=losses.__getitem__)
    return RIDGES[best], losses


def replace_fc(
    g: torch.Tensor,
    q: torch.Tensor,
    features_f: torch.Tensor,
    labels: torch.Tensor,
    w_rand: torch.Tensor | None,
    *,
    total_classnum: int,
    seen: int,
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """One task's update: the new G and Q, the chosen ridge and the head's rows of the ``seen`` classes."""
    y = target2onehot(labels, total_classnum).to(features_f.dtype)
    features_h = torch.relu(features_f @ w_rand) if w_rand is not None else features_f
    q = q + features_h.T @ y
    g = g + features_h.T @ features_h
    ridge, _ = optimise_ridge_parameter(features_h, y)
    wo = torch.linalg.solve(g + ridge * torch.eye(g.size(dim=0), dtype=g.dtype), q).T
    return g, q, ridge, wo[0:seen, :]


def rp_logits(x: torch.Tensor, w_rand: torch.Tensor, weight: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    """CosineLinear.forward with use_RP and W_rand set."""
    return sigma * F.linear(torch.relu(x @ w_rand), weight)
