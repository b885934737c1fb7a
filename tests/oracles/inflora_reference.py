"""An independent reference ("oracle") of InfLoRA's rules as its official code computes them, transcribed from
liangyanshuo/InfLoRA@e08b00e: methods/inflora.py ``_train`` L116-158 (designing A_t) and L188-207 (the second pass,
the projection matrices), ``update_DualGPM`` L321-412; models/vit_inflora.py ``Attention_LoRA.forward`` L232-249 (the
input's second moment, the k and v updates). NumPy for the DualGPM, as the code; no clbench code.

    cur_matrix = (cur_matrix · n + Σ_tokens x x^T) / (n + B·N);  n += B·N        (a running mean over every token)
    task 0:  A = U[:, :r]^T / √3,  U = svd(cur_matrix)
    task t:  A = cU[:, :r]^T / √3,  cU = svd(cur_matrix − P cur_matrix) ("remove") or svd(P cur_matrix) ("retain")
    k' = k + x (Σ_{s<=t} B_s^k A_s^k)^T,  v' likewise
    threshold = (λ_e − λ_b) · t / T + λ_b
"""

from __future__ import annotations

import math

import numpy as np
import torch


def threshold(task: int, total_sessions: int, lamb: float, lame: float) -> float:
    return (lame - lamb) * task / total_sessions + lamb


def running_moment(batches: list[torch.Tensor]) -> torch.Tensor:
    """``cur_matrix`` after the batches (B, N, d) of one pass, from zeros (fp64 here)."""
    d = batches[0].shape[-1]
    matrix, n = torch.zeros(d, d, dtype=torch.float64), 0
    for batch in batches:
        x = batch.double()
        matrix = (matrix * n + torch.bmm(x.permute(0, 2, 1), x).sum(dim=0)) / (n + x.shape[0] * x.shape[1])
        n += x.shape[0] * x.shape[1]
    return matrix


def design_a(
    cur_matrix: torch.Tensor, rank: int, feature_mat: torch.Tensor | None, project_type: str | None
) -> torch.Tensor:
    """A_t (r x d) of one layer."""
    if feature_mat is None:
        u, _, _ = torch.linalg.svd(cur_matrix)
        return u[:, :rank].T / math.sqrt(3)
    if project_type == "remove":
        cur_matrix = cur_matrix - torch.mm(feature_mat, cur_matrix)
    else:
        assert project_type == "retain"
        cur_matrix = torch.mm(feature_mat, cur_matrix)
    c_u, _, _ = torch.linalg.svd(cur_matrix, full_matrices=False)
    return c_u[:, :rank].T / math.sqrt(3)


class DualGPM:
    """``self.feature_list`` / ``self.project_type`` of the InfLoRA learner and ``update_DualGPM``."""

    def __init__(self) -> None:
        self.feature_list: list[np.ndarray] = []
        self.project_type: list[str] = []

    def feature_mat(self) -> list[torch.Tensor]:
        """The precomputed projections U U^T (L203-207)."""
        return [torch.tensor(np.dot(f, f.transpose())) for f in self.feature_list]

    def update(self, mat_list: list[np.ndarray], threshold: float) -> None:
        if len(self.feature_list) == 0:
            for activation in mat_list:
                u, s, _ = np.linalg.svd(activation, full_matrices=False)
                sval_ratio = (s**2) / (s**2).sum()
                r = np.sum(np.cumsum(sval_ratio) < threshold)
                self.feature_list.append(u[:, 0 : max(r, 1)])
                self.project_type.append("remove" if r < (activation.shape[0] / 2) else "retain")
        else:
            for i, activation in enumerate(mat_list):
                _, s1, _ = np.linalg.svd(activation, full_matrices=False)
                sval_total = (s1**2).sum()
                if self.project_type[i] == "remove":
                    act_hat = activation - np.dot(
                        np.dot(self.feature_list[i], self.feature_list[i].transpose()), activation
                    )
                    u, s, _ = np.linalg.svd(act_hat, full_matrices=False)
                    sval_ratio = (s**2) / sval_total
                    accumulated_sval = (sval_total - (s**2).sum()) / sval_total
                    r = 0
                    for ii in range(sval_ratio.shape[0]):
                        if accumulated_sval < threshold:
                            accumulated_sval += sval_ratio[ii]
                            r += 1
                        else:
                            break
                    if r == 0:
                        continue
                    ui = np.hstack((self.feature_list[i], u[:, 0:r]))
                    self.feature_list[i] = ui[:, 0 : ui.shape[0]] if ui.shape[1] > ui.shape[0] else ui
                else:
                    act_hat = np.dot(np.dot(self.feature_list[i], self.feature_list[i].transpose()), activation)
                    u, s, _ = np.linalg.svd(act_hat, full_matrices=False)
                    sval_ratio = (s**2) / sval_total
                    accumulated_sval = (s**2).sum() / sval_total
                    r = 0
                    for ii in range(sval_ratio.shape[0]):
                        if accumulated_sval >= (1 - threshold):
                            accumulated_sval -= sval_ratio[ii]
                            r += 1
                        else:
                            break
                    if r == 0:
                        continue
                    act_feature = self.feature_list[i] - np.dot(
                        np.dot(u[:, 0:r], u[:, 0:r].transpose()), self.feature_list[i]
                    )
                    ui, _, _ = np.linalg.svd(act_feature)
                    self.feature_list[i] = ui[:, : self.feature_list[i].shape[1] - r]
        for i in range(len(self.feature_list)):
            if self.project_type[i] == "remove" and (
                self.feature_list[i].shape[1] > (self.feature_list[i].shape[0] / 2)
            ):
                u, _, _ = np.linalg.svd(self.feature_list[i])
                self.feature_list[i] = u[:, self.feature_list[i].shape[1] :]
                self.project_type[i] = "retain"
            elif self.project_type[i] == "retain":
                assert self.feature_list[i].shape[1] <= (self.feature_list[i].shape[0] / 2)


def kv_update(x: torch.Tensor, a_k: list[torch.Tensor], b_k: list[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, Σ_t B_t A_t)``: the update added to k (or v) of the tokens ``x``."""
    weight = torch.stack([torch.mm(b, a) for a, b in zip(a_k, b_k, strict=True)], dim=0).sum(dim=0)
    return torch.nn.functional.linear(x, weight)
