"""An independent transcription of MOS's official rules (sun-hailong/AAAI25-MOS@8d5e07c) on plain tensors, as the code
computes them, loops and all: the prefix sums and merge map (backbone/vit_mos.py ``sum_adapter_param`` L310-326,
``reweight_adapter`` L328-346), L_proto (models/mos.py ``orth_loss`` L335-355) and the test-time self-refinement and
ensemble (``_eval_cnn`` L357-415, one image at a time). An adapter here is a dict of its four tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Adapter = dict[str, torch.Tensor]
NAMES = ("down.weight", "down.bias", "up.weight", "up.bias")


def sum_adapter_param(sums: list[Adapter], adapter: Adapter) -> None:
    """Append the prefix sum of ``adapter`` (the code appends the first snapshot itself, then previous + snapshot)."""
    sums.append({n: adapter[n].clone() + (sums[-1][n] if sums else 0) for n in NAMES})


def reweight_adapter(adapter: Adapter, sums: list[Adapter], idx: int, momentum: float) -> Adapter:
    """(1 - momentum) * adapter + momentum * sums[idx - 1] / idx; unchanged for idx 0 or momentum 0."""
    if momentum == 0 or idx == 0:
        return adapter
    return {n: (1 - momentum) * adapter[n] + momentum * sums[idx - 1][n] / idx for n in NAMES}


def orth_loss(cls_means: list[torch.Tensor], features: torch.Tensor, reg: float) -> torch.Tensor:
    """reg * CE(M M^T / 0.8, arange) over M = [stacked class means; features] (features alone without means)."""
    M = torch.cat([torch.stack(cls_means), features]) if cls_means else features
    sim = torch.matmul(M, M.t()) / 0.8
    return reg * F.cross_entropy(sim, torch.arange(0, sim.shape[0]).long())


def eval_cnn(
    orig_logits: torch.Tensor,
    all_features: torch.Tensor,
    head: torch.nn.Module,
    cls2task: dict[int, int],
    cur_task: int,
    *,
    ensemble: bool = True,
    max_iter: int = 4,
) -> torch.Tensor:
    """The outputs whose argmax ``_eval_cnn`` predicts: ``orig_logits`` (B, C) the prototype classifier's cosines,
    ``all_features`` (B, tasks, d), ``head`` over the seen classes."""
    total = orig_logits.shape[1]
    orig_preds = torch.max(orig_logits, dim=1)[1].numpy()
    orig_idx = torch.tensor([cls2task[int(v)] for v in orig_preds])
    final_logits = []
    for x_id in range(len(all_features)):
        loop_num = 0
        prev_adapter_idx = orig_idx[x_id]
        while True:
            loop_num += 1
            cur_feature = all_features[x_id, prev_adapter_idx].unsqueeze(0)
            cur_logits = head(cur_feature)[:, :total]
            cur_pred = torch.max(cur_logits, dim=1)[1].numpy()
            cur_adapter_idx = torch.tensor([cls2task[int(v)] for v in cur_pred])[0]
            if loop_num >= max_iter or cur_adapter_idx == prev_adapter_idx:
                break
            prev_adapter_idx = cur_adapter_idx
        final_logits.append(cur_logits)
    final = torch.cat(final_logits, dim=0)
    if not ensemble:
        return final
    return F.softmax(final, dim=1) + F.softmax(orig_logits / (1 / (cur_task + 1)), dim=1)
