"""An independent, plain-PyTorch reference ("oracle") of the Houlsby bottleneck adapter and of a pre-norm ViT block
with two adapters, transcribed from Houlsby et al. (ICML 2019) §2.1 / Fig. 2, the official code
google-research/adapter-bert@1a31fc6 (modeling.py ``feedforward_adapter``, ``gelu``) and BASELINES.md §11.3. It uses
no clbench code and no nn.Module: weights are plain tensors.

Adapter (d: model width, m: bottleneck)::

    A(h) = h + W_up · gelu(W_down · h + b_down) + b_up,       W_down: (m, d), b_down: (m,), W_up: (d, m), b_up: (d,)
    gelu(x) = x · 0.5 · (1 + tanh(sqrt(2 / pi) · (x + 0.044715 x^3)))          (BERT's gelu, the code's φ)

Parameters per adapter: 2md + d + m. A ViT block (timm's pre-norm form, drop-path and layer-scale identities at
evaluation) with per-task norms and adapters::

    x <- x + A1(attn(LN1_t(x)))
    x <- x + A2(mlp(LN2_t(x)))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def adapter(
    h: torch.Tensor, w_down: torch.Tensor, b_down: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor
) -> torch.Tensor:
    """A(h) over the last axis of ``h``."""
    inner = h @ w_down.T + b_down
    return h + gelu_tanh(inner) @ w_up.T + b_up


def adapter_params(d: int, m: int) -> int:
    """2md + d + m (Houlsby §3.6's count of one adapter: two projections and their biases)."""
    return 2 * m * d + d + m


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def adapted_block(
    x: torch.Tensor,
    *,
    attn: Callable[[torch.Tensor], torch.Tensor],
    mlp: Callable[[torch.Tensor], torch.Tensor],
    norm1: tuple[torch.Tensor, torch.Tensor, float],
    norm2: tuple[torch.Tensor, torch.Tensor, float],
    adapter1: tuple[torch.Tensor, ...] | None,
    adapter2: tuple[torch.Tensor, ...] | None,
) -> torch.Tensor:
    """One pre-norm block with the task's norms (weight, bias, eps) and adapters (None: no adapter there)."""
    h = attn(layer_norm(x, *norm1))
    x = x + (h if adapter1 is None else adapter(h, *adapter1))
    h = mlp(layer_norm(x, *norm2))
    return x + (h if adapter2 is None else adapter(h, *adapter2))


def bert_adam_steps(
    theta: list[float], grads: list[list[float]], lr: float, weight_decay: float, eps: float = 1e-6
) -> list[float]:
    """adapter-bert optimization.py ``AdamWeightDecayOptimizer.apply_gradients`` (L118-160), one scalar parameter at a
    time: next_m = 0.9 m + 0.1 g, next_v = 0.999 v + 0.001 g², update = next_m / (sqrt(next_v) + eps)
    (+ weight_decay x param), param -= lr x update. No bias correction. ``grads[k]`` is step k's gradient."""
    out = list(theta)
    m = [0.0] * len(theta)
    v = [0.0] * len(theta)
    for g in grads:
        for i, gi in enumerate(g):
            m[i] = 0.9 * m[i] + (1.0 - 0.9) * gi
            v[i] = 0.999 * v[i] + (1.0 - 0.999) * gi * gi
            update = m[i] / (math.sqrt(v[i]) + eps) + weight_decay * out[i]
            out[i] = out[i] - lr * update
    return out
