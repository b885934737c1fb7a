"""An independent, plain-PyTorch reference ("oracle") of TUNA's rules, transcribed from the official code (upstream
commit 77d4f10, read through Ngahoang2005/ICCV2025-TUNA): ``backbone/vit_tuna.py`` (``emr_merge`` L82-115, the
adapter's forward L157-171), ``backbone/linears.py`` (``SimpleContinualLinear.forward`` L56-62) and ``models/tuna.py``
(``AngularPenaltySMLoss`` L17-53, ``orth_loss`` L217-233, the mean decay of ``classifer_align`` L281-296,
``_eval_cnn`` L376-423), loops and all. No clbench code. An adapter is a dict of its tensors as the code names them
(``down_proj.weight`` ...); a set of adapters a list of them, one per block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def emr_merge(task_vectors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """vit_tuna.py L82-107: the unified vector (the masks and rescalers it also computes are never used)."""
    sum_param: dict[str, list[torch.Tensor]] = {}
    for vector in task_vectors:
        for n in vector:
            sum_param.setdefault(n, []).append(vector[n])
    mean = {k: torch.stack(v, 0).mean(0) for k, v in sum_param.items()}
    unified = {}
    for n, average in mean.items():
        flag = (average > 0) * 2 - 1
        param_max = torch.zeros_like(task_vectors[0][n])
        for vector in task_vectors:
            param = vector[n]
            mask = (param * flag) > 0
            param_abs = torch.abs(mask * param)
            param_max = torch.where(param_abs > param_max, param_abs, param_max)
        unified[n] = param_max * flag
    return unified


def cosface(wf: torch.Tensor, labels: torch.Tensor, s: float = 20.0, m: float = 0.0) -> torch.Tensor:
    """AngularPenaltySMLoss(loss_type='cosface').forward, L37-53."""
    numerator = s * (torch.diagonal(wf.transpose(0, 1)[labels]) - m)
    excl = torch.cat([torch.cat((wf[i, :y], wf[i, y + 1 :])).unsqueeze(0) for i, y in enumerate(labels)], dim=0)
    denominator = torch.exp(numerator) + torch.sum(torch.exp(s * excl), dim=1)
    return -torch.mean(numerator - torch.log(denominator))


def orth_loss(cur: list[torch.Tensor], stored: list[list[torch.Tensor]], blocks: int) -> torch.Tensor:
    """models/tuna.py L217-233 (``range(12)`` there: the ViT-B's blocks; ``blocks`` here): ``cur[j]`` and
    ``stored[i][j]`` the up_proj weights of block j."""
    final_loss = torch.zeros(())
    for i in range(len(stored)):
        loss = torch.zeros(())
        for j in range(blocks):
            cur_n = F.normalize(cur[j], p=2, dim=1)
            prev_n = F.normalize(stored[i][j], p=2, dim=1)
            dot_product = torch.mean(torch.matmul(cur_n, prev_n.transpose(1, 0)))
            loss += torch.abs(dot_product) / blocks
        final_loss += loss
    return final_loss


def decayed_mean(mean: torch.Tensor, class_idx: int, known: int, total: int, cur_task: int) -> torch.Tensor:
    """classifer_align L281, L291-296 with ``decay``: task_size = known - total (negative)."""
    task_size = known - total
    t_id = class_idx // task_size
    decay = (t_id + 1) / (cur_task + 1) * 0.1
    return mean.double() * (0.9 + decay)


def cosine_logits(features: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """SimpleContinualLinear.forward L56-62: cos against every task's head, concatenated."""
    return torch.cat([F.linear(F.normalize(features, p=2, dim=1), F.normalize(w, p=2, dim=1)) for w in weights], 1)


def eval_cnn(per_adapter_features: list[torch.Tensor], universal_features: torch.Tensor, weights: list[torch.Tensor],
             scale: float = 20.0) -> torch.Tensor:  # fmt: skip
    """_eval_cnn L376-423's outputs for one batch: after task 0 the cosines through adapter 0; later
    softmax(universal) + softmax(the least-entropy adapter's), each logit scaled."""
    if len(per_adapter_features) == 1:
        return cosine_logits(per_adapter_features[0], weights)
    all_entropies, all_logits = [], []
    for features in per_adapter_features:
        logits = cosine_logits(features, weights) * scale
        probs = F.softmax(logits, dim=1)
        all_entropies.append(-torch.sum(probs * torch.log(probs + 1e-10), dim=1))
        all_logits.append(logits)
    entropies, stacked = torch.stack(all_entropies), torch.stack(all_logits)
    chosen = torch.argmin(entropies, dim=0)
    min_entropy_logits = stacked[chosen, torch.arange(len(chosen))]
    universal = F.softmax(cosine_logits(universal_features, weights) * scale, dim=1)
    return universal + F.softmax(min_entropy_logits, dim=1)
