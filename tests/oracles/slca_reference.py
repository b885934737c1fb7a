"""An independent transcription ("oracle") of SLCA's official rules, for use as a test reference.

Written from the official code (GengDavid/SLCA @ 169d4e6), statement by statement, without reading clbench's
implementation: models/base.py ``_compute_class_mean`` (L247-270), models/slca.py ``_stage1_training`` (L146-171),
``_run`` (L116-143) and ``_stage2_compact_classifier`` (L174-256), convs/linears.py ``SimpleContinualLinear``
(L25-110), convs/vits.py ``vit_base_patch16_224_in21k`` (L701-712). Only the random draws are left to the caller
(the class samples and the shuffle: the test hands both codes the same), so that the two can be compared number for
number.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim


def class_statistics(vectors: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """base.py L260-262: the class mean (NumPy) and torch.cov of the fp64 features + 1e-4 I."""
    class_mean = np.mean(vectors, axis=0)
    class_cov = torch.cov(torch.tensor(vectors, dtype=torch.float64).T) + torch.eye(class_mean.shape[-1]) * 1e-4
    return class_mean, class_cov


def mean_factor(c_id: int, task_size: int, cur_task: int) -> float:
    """slca.py L199-201: the factor on class ``c_id``'s mean at task ``cur_task``."""
    t_id = c_id // task_size
    decay = (t_id + 1) / (cur_task + 1) * 0.1
    return 0.9 + decay


def ca_loss(
    logits: torch.Tensor, tgt: torch.Tensor, task_sizes: list[int], cur_task: int, logit_norm: float | None
) -> torch.Tensor:
    """slca.py L228-245, as written (``crct_num`` = the classes seen so far)."""
    crct_num = sum(task_sizes[: cur_task + 1])
    if logit_norm is not None:
        per_task_norm = []
        prev_t_size = 0
        cur_t_size = 0
        for _ti in range(cur_task + 1):
            cur_t_size += task_sizes[_ti]
            temp_norm = torch.norm(logits[:, prev_t_size:cur_t_size], p=2, dim=-1, keepdim=True) + 1e-7
            per_task_norm.append(temp_norm)
            prev_t_size += task_sizes[_ti]
        per_task_norm = torch.cat(per_task_norm, dim=-1)
        norms = per_task_norm.mean(dim=-1, keepdim=True)
        decoupled_logits = torch.div(logits[:, :crct_num], norms) / logit_norm
        return F.cross_entropy(decoupled_logits, tgt)
    return F.cross_entropy(logits[:, :crct_num], tgt)


class ContinualLinear(nn.Module):
    """linears.py SimpleContinualLinear without its unused options: one Linear a task, logits concatenated; the old
    heads frozen when a task's head is added; ``backup``/``recall`` of the whole state."""

    def __init__(self, heads: list[nn.Linear]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def backup(self) -> None:
        self.old_state_dict = copy.deepcopy(self.state_dict())

    def recall(self) -> None:
        self.load_state_dict(self.old_state_dict)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([head(x) for head in self.heads], dim=1)


def stage1_optimizer(
    convnet: nn.Module, fc: ContinualLinear, lrate: float, bcb_lrscale: float, weight_decay: float
) -> optim.SGD:
    """slca.py L154-165: the backbone at lrate x bcb_lrscale and the trainable heads at lrate, both with weight decay,
    in one SGD with momentum 0.9."""
    base_params = convnet.parameters()
    base_fc_params = [p for p in fc.parameters() if p.requires_grad]
    base_params = {"params": base_params, "lr": lrate * bcb_lrscale, "weight_decay": weight_decay}
    base_fc_params = {"params": base_fc_params, "lr": lrate, "weight_decay": weight_decay}
    return optim.SGD([base_params, base_fc_params], lr=lrate, momentum=0.9, weight_decay=weight_decay)


def stage1_loss(logits: torch.Tensor, targets: torch.Tensor, known_classes: int) -> torch.Tensor:
    """slca.py L126-128: cross-entropy over the current task's logits."""
    cur_targets = torch.where(targets - known_classes >= 0, targets - known_classes, -100)
    return F.cross_entropy(logits[:, known_classes:], cur_targets)


def stage2(
    fc: ContinualLinear,
    epochs_of_samples: list[tuple[torch.Tensor, torch.Tensor]],
    task_sizes: list[int],
    cur_task: int,
    *,
    num_sampled_pcls: int,
    lrate: float = 0.01,
    weight_decay: float = 5e-4,
    logit_norm: float | None = 0.1,
) -> None:
    """slca.py L174-256 on ``fc`` (trained in place): every head trainable, SGD (momentum 0.9, weight decay), cosine
    annealing over the epochs stepped once an epoch, ``crct_num`` steps of ``num_sampled_pcls`` samples an epoch.
    ``epochs_of_samples``: each epoch's samples and labels, already shuffled (the code draws and shuffles them)."""
    for p in fc.parameters():
        p.requires_grad = True
    run_epochs = len(epochs_of_samples)
    crct_num = sum(task_sizes[: cur_task + 1])
    param_list = [p for p in fc.parameters() if p.requires_grad]
    network_params = [{"params": param_list, "lr": lrate, "weight_decay": weight_decay}]
    optimizer = optim.SGD(network_params, lr=lrate, momentum=0.9, weight_decay=weight_decay)
    scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer=optimizer, T_max=run_epochs)
    for inputs, targets in epochs_of_samples:
        for _iter in range(crct_num):
            inp = inputs[_iter * num_sampled_pcls : (_iter + 1) * num_sampled_pcls]
            tgt = targets[_iter * num_sampled_pcls : (_iter + 1) * num_sampled_pcls]
            logits = fc(inp)
            loss = ca_loss(logits, tgt, task_sizes, cur_task, logit_norm)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()


def final_norm(embed_dim: int) -> nn.LayerNorm:
    """vits.py L709-711: ``del model.norm; model.norm = nn.LayerNorm(768)``: a fresh LayerNorm."""
    return nn.LayerNorm(embed_dim)
