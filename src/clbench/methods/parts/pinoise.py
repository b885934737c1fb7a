"""Pi-Noise layers after every block of a ViT: MIN's noise generators (Jiang, Shi, Zhang, Zhang, Li, "Mixture of Noise
for Pre-Trained Model-Based Class-Incremental Learning", NeurIPS 2025, §4, Eq. 7-13; official code
ASCIIJK/MiN-NeurIPS2025@292d883 MiN/backbones/ViT_MiN.py ``PiNoise`` L64-169, ``forward_features`` L792-804).

After block l, on every token r of its output (Eq. 7 and 10):

    P_l(r) = r + MLP(r) + [sum_i omega_i eps_i(r)] W_up,     eps_i(r) = mu_i(r W_down) + xi * sigma_i(r W_down)

- W_down in R^{d x d2}, entries U(+-1/sqrt(d2)), and W_up in R^{d2 x d}, entries U(+-1/sqrt(d)): fixed, the code's
  ``nn.Linear`` initialisation applied to (in, out)-shaped tensors, whose bound is 1/sqrt of the second dimension
  (L78-91; the paper says N(0, 1) entries, §4.1); drawn from a seed, so they are kept as it;
- mu_i, sigma_i: one pair of Linear(d2, d2) with bias per task, zero at first (Noise Expansion, L95-110);
- omega: the mixture weights, one per generator, shared by every layer (Noise Mixture, Eq. 11-13; the code keeps equal
  copies per layer, L112-128);
- xi ~ N(0, I) while sampling, one draw per layer and token, shared by the generators (Eq. 8-9's eps, one signal for
  every task's noise); otherwise xi = 1: the code adds sigma_i's output as it is (L137-154);
- MLP: Linear(d, d) with bias, zero at first: the code's residual MLP (L68-72), absent from the paper
  (``residual_mlp``).

The generators are linear maps, so the mixture is one pair of maps, sum_i omega_i mu_i and sum_i omega_i sigma_i,
formed once per forward: a layer costs two d2 x d2 products per token however many tasks it has mixed. Each layer runs
as a forward hook of its block, so the ViT's own modules keep their names. While its MLP and generators are zero a
layer is the identity. Everything is per token: an image's output never depends on the other images of its batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn


def uniform_fan_in(rows: int, cols: int, seed: int) -> torch.Tensor:
    """(rows x cols) entries U(+-1/sqrt(cols)), drawn on the CPU from ``seed`` alone: ``nn.Linear.reset_parameters``
    (Kaiming-uniform, a = sqrt 5) on a tensor of that shape, as MIN's code initialises its fixed matrices."""
    bound = 1.0 / math.sqrt(cols)
    return torch.empty(rows, cols).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))


def zero_linear(width_in: int, width_out: int, device: torch.device) -> nn.Linear:
    layer = nn.Linear(width_in, width_out, device=device)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class PiNoise(nn.Module):
    """One Pi-Noise layer: the fixed projections (buffers redrawn from their seeds, not saved), the optional residual
    MLP and the per-task generators."""

    def __init__(self, dim: int, hidden: int, *, residual_mlp: bool, device: torch.device) -> None:
        super().__init__()
        self.dim, self.hidden = dim, hidden
        self.register_buffer("down", torch.empty(dim, hidden, device=device), persistent=False)
        self.register_buffer("up", torch.empty(hidden, dim, device=device), persistent=False)
        self.mlp = zero_linear(dim, dim, device) if residual_mlp else None
        self.mu = nn.ModuleList()
        self.sigma = nn.ModuleList()

    def draw(self, seed: int) -> None:
        """W_down and W_up from ``seed`` (two streams of it)."""
        device = self.down.device
        self.down = uniform_fan_in(self.dim, self.hidden, hash((seed, 0)) % 2**63).to(device)
        self.up = uniform_fan_in(self.hidden, self.dim, hash((seed, 1)) % 2**63).to(device)

    def expand(self) -> None:
        """A new task's generator pair, zero (``update_noise``)."""
        for bank in (self.mu, self.sigma):
            bank.append(zero_linear(self.hidden, self.hidden, self.down.device))

    def mixed(self, omega: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """sum_i omega_i mu_i and sum_i omega_i sigma_i as (weight, bias) pairs."""
        out = []
        for bank in (self.mu, self.sigma):
            weight = torch.einsum("i,ijk->jk", omega, torch.stack([g.weight for g in bank]))
            bias = omega @ torch.stack([g.bias for g in bank])
            out += [weight, bias]
        return tuple(out)

    def forward(self, r: torch.Tensor, omega: torch.Tensor, xi: torch.Tensor | None = None) -> torch.Tensor:
        """P(r) for tokens ``r`` (..., d), with the draws ``xi`` (..., d2) or without (the code's mu + sigma)."""
        out = r
        if self.mlp is not None:
            out = out + self.mlp(r)
        if len(self.mu):
            mu_w, mu_b, sigma_w, sigma_b = self.mixed(omega)
            z = r @ self.down
            sigma = F.linear(z, sigma_w, sigma_b)
            noise = F.linear(z, mu_w, mu_b) + (sigma if xi is None else xi * sigma)
            out = out + noise @ self.up
        return out


class NoiseLayers(nn.Module):
    """The Pi-Noise layers of a ViT (``layers[l]`` after ``blocks[l]``), the mixture weights ``omega`` they share, and
    the draws of a training step: set :attr:`share` (the whole batch's size and this rank's rows) to sample xi for the
    whole batch and keep this rank's rows, as a single process would draw them."""

    def __init__(self, vit: VisionTransformer, hidden: int, *, residual_mlp: bool, seed: int) -> None:
        super().__init__()
        device = vit.pos_embed.device
        self.layers = nn.ModuleList(
            PiNoise(vit.embed_dim, hidden, residual_mlp=residual_mlp, device=device) for _ in vit.blocks
        )
        self.omega = nn.Parameter(torch.zeros(0, device=device), requires_grad=False)
        self.share: tuple[int, slice] | None = None  # set while a training step samples
        self.redraw(seed)
        for index, block in enumerate(vit.blocks):
            block.register_forward_hook(Hook(self, index))

    def redraw(self, seed: int) -> None:
        """Every layer's W_down and W_up from ``seed`` (layer l from its own stream)."""
        for index, layer in enumerate(self.layers):
            layer.draw(hash((seed, index)) % 2**63)

    @property
    def tasks(self) -> int:
        """Generators per layer."""
        return len(self.layers[0].mu)

    def expand(self, omega: torch.Tensor, *, trainable: bool) -> None:
        """Up to ``len(omega)`` generators per layer (a new task's, zero), and the weights ``omega`` mixing them."""
        while self.tasks < len(omega):
            for layer in self.layers:
                layer.expand()
        self.omega = nn.Parameter(omega.to(self.omega.device).float(), requires_grad=trainable)

    def newest(self) -> list[nn.Parameter]:
        """The newest task's generators, every layer's."""
        return [p for layer in self.layers for bank in (layer.mu, layer.sigma) for p in bank[-1].parameters()]

    def mlps(self) -> list[nn.Parameter]:
        return [p for layer in self.layers if layer.mlp is not None for p in layer.mlp.parameters()]

    def noisy(self, index: int, tokens: torch.Tensor) -> torch.Tensor:
        """Layer ``index`` on a block's output, sampling xi where :attr:`share` says so."""
        xi = None
        if self.share is not None and self.tasks:
            size, part = self.share
            xi = torch.randn(size, *tokens.shape[1:-1], self.layers[index].hidden, device=tokens.device)[part]
        return self.layers[index](tokens, self.omega, xi)

    def generator_numel(self) -> int:
        """Parameters of one task's generators over every layer: 2 (d2^2 + d2) a layer."""
        return sum(2 * (layer.hidden**2 + layer.hidden) for layer in self.layers)


class Hook:
    """A block's forward hook: its output through Pi-Noise layer ``index`` (a picklable, copyable callable; a deep copy
    of the ViT and its :class:`NoiseLayers` together points the copy's hook at the copy's layers)."""

    def __init__(self, owner: NoiseLayers, index: int) -> None:
        self.owner, self.index = owner, index

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return self.owner.noisy(self.index, output)
