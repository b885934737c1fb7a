"""An independent, plain-PyTorch reference ("oracle") of SD-LoRA's network as its official code computes it,
transcribed from WuYichen-97/SD-Lora-CL@8bacded: backbone/lora.py ``_LoRA_qkv_timm_train.forward`` L153-195,
``LoRA_ViT_timm.__init__`` L278-360 and ``reset_parameters`` L378-384; models/sdlora.py ``update_network`` L68-90,
``_train`` L92-122 and ``_update_representation`` L216-236; backbone/linears.py ``SimpleLinear`` L11-32. No clbench
code: the ViT is timm's (as the code's), with each block's ``attn.qkv`` replaced by :class:`LoRAQKVTrain`.

Per block, at task t (earlier pairs (A_i, B_i) loaded from the files the code saved, fixed)::

    new_q = Σ_{i<t} α'_i · B_q,i (A_q,i x) / (‖B_q,i‖ ‖A_q,i‖)  +  α_t · B_q,t (A_q,t x)     (‖·‖ = torch.norm: Frobenius)
    new_v = the same with the v pairs
    qkv = W_qkv x + b;  qkv[..., :d] += new_q;  qkv[..., -d:] += new_v

α'_i (``wrapped_param_prev``) and α_t (``wrapped_param``) are built at every ``update_network``, all 0.8; the new pair
is A Kaiming-uniform (a = √5), B = 0. The head is ``SimpleLinear``: Kaiming-uniform with the linear gain, bias 0. Loss at
task t > 0: cross-entropy over the logits of the task's classes, labels shifted by the known classes; at task 0 over all.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ALPHA = 0.8  # torch.Tensor([0.8]) in LoRA_ViT_timm.__init__
SLOTS = 20  # wrapped_param_prev: 20 ParameterWrappers


class LoRAQKVTrain(nn.Module):
    """``_LoRA_qkv_timm_train``: ``qkv`` the pretrained Linear, ``saved`` the earlier tasks' (A_q, B_q, A_v, B_v) weight
    tensors, ``current`` this task's four weights, ``scaling`` α_t and ``scaling_prev`` the α' list (shared by every
    block, as the code passes one ModuleList to all of them)."""

    def __init__(
        self,
        qkv: nn.Linear,
        saved: list[tuple[torch.Tensor, ...]],
        current: tuple[torch.Tensor, ...],
        scaling: torch.Tensor,
        scaling_prev: list[torch.Tensor],
    ) -> None:
        super().__init__()
        self.qkv = qkv
        self.dim = qkv.in_features
        self.saved = saved
        self.current = current
        self.scaling = scaling
        self.scaling_prev = scaling_prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new_q, new_v = 0, 0
        for i, (a_q, b_q, a_v, b_v) in enumerate(self.saved):
            q = F.linear(F.linear(x, a_q), b_q) / (torch.norm(b_q) * torch.norm(a_q))
            v = F.linear(F.linear(x, a_v), b_v) / (torch.norm(b_v) * torch.norm(a_v))
            new_q = new_q + self.scaling_prev[i] * q
            new_v = new_v + self.scaling_prev[i] * v
        a_q, b_q, a_v, b_v = self.current
        new_q = new_q + self.scaling * F.linear(F.linear(x, a_q), b_q)
        new_v = new_v + self.scaling * F.linear(F.linear(x, a_v), b_v)
        qkv = self.qkv(x)
        qkv[:, :, : self.dim] += new_q
        qkv[:, :, -self.dim :] += new_v
        return qkv


def new_pair(dim: int, rank: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``reset_parameters``: A (r x d) Kaiming-uniform with a = √5 (bound 1/√d), B (d x r) zeros."""
    bound = 1 / math.sqrt(dim)
    a = (torch.rand(rank, dim, generator=generator) * 2 - 1) * bound
    return a, torch.zeros(dim, rank)


def simple_linear(in_features: int, out_features: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``SimpleLinear.reset_parameters``: kaiming_uniform_(nonlinearity='linear'): U(±√(3 / in)); bias 0."""
    bound = math.sqrt(3 / in_features)
    return (torch.rand(out_features, in_features, generator=generator) * 2 - 1) * bound, torch.zeros(out_features)


def update_network_scalings() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The magnitudes a rebuilt network starts with: α_t and the 20 α' all 0.8."""
    return torch.tensor([ALPHA]), [torch.tensor([ALPHA]) for _ in range(SLOTS)]


def loss(logits: torch.Tensor, targets: torch.Tensor, known: int, task: int) -> torch.Tensor:
    """``_init_train`` (task 0): CE over every logit; ``_update_representation``: over the new classes' logits."""
    if task == 0:
        return F.cross_entropy(logits, targets)
    return F.cross_entropy(logits[:, known:], targets - known)
