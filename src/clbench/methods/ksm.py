"""KSM (Yang, He, Zhang & Fan, CVPR 2021): one kernel-wise soft mask per task over a fixed backbone.

**A reconstruction.** What could be verified (abstract, introduction, Fig. 3's caption): the backbone is fixed; each
task learns one real value per *kernel* (all k x k weights of one (c_out, c_in) pair share it); the soft mask is a
binary mask plus a scaled real tensor (Eq. 4), the binary part comes from the real mask through a logistic
(Eq. 6) and a softmax (Eq. 8), the scale from the real mask (Eq. 5), and the gradient reaches the real mask
without any estimator (no straight-through). The equations themselves could not be read; clbench's are:

    p = sigmoid(M^r)                         (Eq. 6)
    M^b = softmax([p, 1 - p] / T)[0]          (Eq. 8: near-binary for a small temperature T)
    A^s = alpha (p - sigmoid(m0)) M^b         (Eq. 5, reconstructed: 0 at the initial value m0, 0 where M^b is)
    M = M^b + A^s                             (Eq. 4)     W_t = W * M, broadcast over each kernel

so a task starts from the backbone (M = M^b(m0) ~ 1), may rescale a kept kernel within [1 - alpha p0, 1 + alpha
(1 - p0)], and drops it when p falls below 1/2. After the task only M is kept (float16, one value per kernel).

ViT adaptation (design choice): a timm Linear is a 1 x 1 convolution, so a kernel is one weight and the mask is
element-wise (``group=1``); ``group=g`` shares one value across g consecutive input columns of a row (a 1 x g
kernel: g times fewer values). ``patch_embed.proj`` (a true Conv2d) gets one value per (c_out, c_in) kernel.
The backbone (weights, biases, LayerNorms, embeddings) never changes; one head per task; task-incremental.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from clbench.config import require
from clbench.methods.masked_method import ScoredMaskMethod
from clbench.methods.masking import DEFAULT_TARGETS, MaskedConv2d, MaskedLayer, buffer_name

STORED_DTYPE = torch.float16  # the soft mask kept per task


@dataclass
class KSMConfig:
    temperature: float = 0.1  # T of the binary part's softmax (Eq. 8) [clbench's choice: paper value unknown]
    alpha: float = 1.0  # scale of the real part A^s (Eq. 5) [clbench's choice]
    init: float = 2.0  # m0, every real-mask value at task start: p0 = sigmoid(2) = 0.88, M^b = 0.9995
    group: int = 1  # input columns of a Linear row sharing one mask value (1: a Linear's kernel, one weight)
    mask_lr: float | None = None  # learning rate of the real masks (null: trainer.lr)
    layers: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self) -> None:
        require(self.temperature > 0, "method.temperature", self.temperature, "a float > 0")
        require(self.alpha >= 0, "method.alpha", self.alpha, "a float >= 0")
        require(math.isfinite(self.init), "method.init", self.init, "a finite float")
        require(isinstance(self.group, int) and self.group >= 1, "method.group", self.group, "an integer >= 1")
        require(self.mask_lr is None or self.mask_lr > 0, "method.mask_lr", self.mask_lr, "null or a float > 0")


def binary_part(real: torch.Tensor, temperature: float) -> torch.Tensor:
    """M^b = softmax([p, 1 - p] / T)[0] with p = sigmoid(M^r) (Eqs. 6 and 8), computed as its equal
    sigmoid((2p - 1) / T): a two-way softmax is the difference's sigmoid (no softmax on a weight-sized tensor)."""
    return torch.sigmoid((2 * torch.sigmoid(real) - 1) / temperature)


def soft_mask(real: torch.Tensor, temperature: float, alpha: float, init: float) -> torch.Tensor:
    """M = M^b + A^s with A^s = alpha (sigmoid(M^r) - sigmoid(m0)) M^b (Eqs. 4-5): differentiable, no estimator."""
    binary = binary_part(real, temperature)
    return binary + alpha * (torch.sigmoid(real) - 1 / (1 + math.exp(-init))) * binary


def kernel_shape(layer: MaskedLayer, group: int) -> tuple[int, ...]:
    """One value per kernel: (c_out, c_in) for a Conv2d, (out, in / group) for a Linear."""
    if isinstance(layer, MaskedConv2d):
        return tuple(layer.weight.shape[:2])
    return (layer.weight.shape[0], layer.weight.shape[1] // group)


def expand(mask: torch.Tensor, layer: MaskedLayer, group: int) -> torch.Tensor:
    """A kernel-level mask broadcast to the layer's weight."""
    if isinstance(layer, MaskedConv2d):
        return mask[:, :, None, None]
    return mask.repeat_interleave(group, dim=1) if group > 1 else mask


class KSM(ScoredMaskMethod):
    """Kernel-wise soft masks (reconstructed, see the module docstring); results.json marks it ``reconstructed``. The
    scores are the real masks M^r, one a kernel; the soft mask, not a binary one, multiplies the weights."""

    Config = KSMConfig
    reconstructed = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        widths = sorted(
            {layer.weight.shape[1] for layer in self.layers.values() if not isinstance(layer, MaskedConv2d)}
        )
        common = math.gcd(*widths)
        require(
            common % self.config.group == 0,
            "method.group",
            self.config.group,
            f"a divisor of every masked Linear's input width ({', '.join(map(str, widths))}): "
            + ", ".join(str(d) for d in range(1, common + 1) if common % d == 0),
        )

    def soft(self, real: torch.Tensor) -> torch.Tensor:
        return soft_mask(real, self.config.temperature, self.config.alpha, self.config.init)

    def init_scores(self, layer: MaskedLayer) -> torch.Tensor:
        return torch.full(kernel_shape(layer, self.config.group), self.config.init, device=layer.weight.device)

    def binarize(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        """The soft mask M broadcast to the layer's weight (no binarisation, no straight-through)."""
        return expand(self.soft(scores), self.layers[name], self.config.group)

    def final_mask(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        return self.soft(scores)  # kept a value a kernel

    def stored_mask(self, name: str, task_id: int) -> torch.Tensor | None:
        mask = self.kernel_mask(name, task_id)
        return None if mask is None else expand(mask, self.layers[name], self.config.group)

    def store_mask(self, name: str, task_id: int, mask: torch.Tensor) -> None:
        self.register_buffer(f"mask_{task_id}_{buffer_name(name)}", mask.detach().to(STORED_DTYPE))

    # ----------------------------------------------------------------------------- bookkeeping
    def mask_bits_per_task(self) -> int:
        """16 bits per kernel: the float16 soft mask."""
        bits = torch.finfo(STORED_DTYPE).bits
        return sum(bits * math.prod(kernel_shape(layer, self.config.group)) for layer in self.layers.values())

    def kernel_mask(self, name: str, task_id: int) -> torch.Tensor | None:
        """Task ``task_id``'s stored soft mask of layer ``name``, one value per kernel."""
        return getattr(self, f"mask_{task_id}_{buffer_name(name)}", None)

    def saved_mask(self, name: str, task_id: int) -> torch.Tensor | None:
        mask = self.kernel_mask(name, task_id)
        return None if mask is None else mask.clone()

    def restore_mask(self, name: str, task_id: int, saved: torch.Tensor) -> None:
        self.store_mask(name, task_id, saved.to(self.layers[name].weight.device))
