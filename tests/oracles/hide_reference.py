"""An independent transcription ("oracle") of HiDe-Prompt's and HiDe-LoRA's official rules, for use as a test
reference.

Written from the official code (thu-ml/HiDe-Prompt @ 0ed4333), statement by statement, without reading clbench's
implementation: peft/prompt/hide_prompt.py (the E-prompt's selection, momentum and prefix reshape, L92-119),
vits/hide_prompt_vision_transformer.py ``MlpMapping`` (L321-369), engines/hide_tii_engine.py ``_compute_mean``
(multi-centroid, L175-202) and the alignment's step count (L297-298, L352), engines/hide_promtp_wtp_and_tap_engine.py
``orth_loss`` (L528-547), the prompt momentum after training (L315-324) and evaluation's task map (L99-166),
peft/lora/hide_lora.py (L19-78). KMeans gets a seed here (the code's has none) so that the two can be compared.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def official_prefixes(prompt: torch.Tensor, prompt_idx: torch.Tensor) -> torch.Tensor:
    """hide_prompt.py: ``prompt`` (layers, 2, pool, length, heads, head_dim), ``prompt_idx`` (B, top_k) ->
    batched_prompt_raw = prompt[:, :, idx] (layers, 2, B, top_k, length, H, hd), reshaped without a permute to
    (layers, B, 2, top_k * length, H, hd)."""
    raw = prompt[:, :, prompt_idx]
    num_layers, dual, batch_size, top_k, length, num_heads, heads_embed_dim = raw.shape
    return raw.reshape(num_layers, batch_size, dual, top_k * length, num_heads, heads_embed_dim)


def momentum_prompt(prompt: torch.Tensor, task_id: int, prompt_momentum: float) -> torch.Tensor:
    """Engine L318-324: prompt[:, :, task_id] <- (1 - m) prompt[:, :, task_id] + m prompt[:, :, 0:task_id].mean(dim=2)
    (the pool on dim 2)."""
    out = prompt.clone()
    out[:, :, task_id] = (1 - prompt_momentum) * prompt[:, :, task_id] + prompt_momentum * prompt[:, :, 0:task_id].mean(
        dim=2
    )
    return out


class MlpMapping(nn.Module):
    """vit L321-369 with hidden [h]: [Linear(dim, dim h), GELU, Dropout(0)], [Linear(dim h, dim), Dropout(0)];
    out += x; LayerNorm(dim)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(dim, dim * hidden), nn.GELU(), nn.Dropout(0.0)),
                nn.Sequential(nn.Linear(dim * hidden, dim), nn.Dropout(0.0)),
            ]
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for layer in self.net:
            out = layer(out)
        out += x
        return self.norm(out)


def multi_centroid(features_per_cls: np.ndarray, n_clusters: int, seed: int) -> tuple[list, list]:
    """_compute_mean's multi-centroid branch: KMeans(n_clusters).fit, then each cluster's np.mean and np.var (fp64)."""
    from sklearn.cluster import KMeans

    kmeans = KMeans(n_clusters=n_clusters, random_state=seed, n_init="auto")
    kmeans.fit(features_per_cls)
    cluster_lables = kmeans.labels_
    cluster_means, cluster_vars = [], []
    for i in range(n_clusters):
        cluster_data = features_per_cls[cluster_lables == i]
        cluster_means.append(torch.tensor(np.mean(cluster_data, axis=0), dtype=torch.float64))
        cluster_vars.append(torch.tensor(np.var(cluster_data, axis=0), dtype=torch.float64))
    return cluster_means, cluster_vars


def alignment_steps(class_mask: list[list[int]], task_id: int) -> int:
    """crct_num: the number of classes of tasks 0 .. task_id - 1."""
    crct_num = 0
    for i in range(task_id):
        crct_num += len(class_mask[i])
    return crct_num


def sampled_count(cls_cov: dict[int, list[torch.Tensor]], num_sampled_pcls: int) -> int:
    """How many samples an epoch draws: num_sampled_pcls per cluster whose variance's mean is not 0."""
    return sum(num_sampled_pcls for vars_ in cls_cov.values() for var in vars_ if var.mean() != 0)


def orth_loss(features: torch.Tensor, cls_mean: dict, reg: float) -> torch.Tensor:
    """Engine L528-547."""
    if cls_mean:
        sample_mean = []
        for v in cls_mean.values():
            if isinstance(v, list):
                sample_mean.extend(v)
            else:
                sample_mean.append(v)
        sample_mean = torch.stack(sample_mean, dim=0)
        m = torch.cat([sample_mean, features], dim=0)
        sim = torch.matmul(m, m.t()) / 0.8
        return reg * F.cross_entropy(sim, torch.arange(sim.shape[0]).long())
    sim = torch.matmul(features, features.t()) / 0.8
    return reg * F.cross_entropy(sim, torch.arange(sim.shape[0]).long())


def tii_task(logits: torch.Tensor, class_mask: list[list[int]], task_id: int, nb_classes: int) -> torch.Tensor:
    """Evaluation's task inference: logits of classes outside tasks 0..task_id at -inf, argmax, target_task_map."""
    mask = []
    for i in range(task_id + 1):
        mask.extend(class_mask[i])
    not_mask = torch.tensor(np.setdiff1d(np.arange(nb_classes), mask), dtype=torch.int64)
    logits = logits.index_fill(dim=1, index=not_mask, value=float("-inf"))
    prompt_id = torch.max(logits, dim=1)[1]
    target_task_map = {c: t for t, classes in enumerate(class_mask) for c in classes}
    return torch.tensor([target_task_map[v.item()] for v in prompt_id])


def lora_qkv_update(x: torch.Tensor, k_pair: tuple, v_pair: tuple, rank: int) -> torch.Tensor:
    """hide_lora.py: per-sample k and v updates x @ A @ B / r ((A, B) pairs: A (B, d, r), B (B, r, w) gathered by each
    sample's task), the q part zero: the added qkv (B, N, 3w)."""
    k = torch.bmm(torch.bmm(x, k_pair[0]), k_pair[1]) / rank
    v = torch.bmm(torch.bmm(x, v_pair[0]), v_pair[1]) / rank
    return torch.cat([torch.zeros_like(k), k, v], dim=-1)
