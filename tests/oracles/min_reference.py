"""An independent, plain-PyTorch reference ("oracle") of MIN's rules, transcribed from the official code
ASCIIJK/MiN-NeurIPS2025@292d883 (read through its public forks) and, where marked, from the paper's equations
(Jiang et al., NeurIPS 2025). No clbench code.

- ``RandomBuffer`` (MiN/utils/inc_net.py L52-68): W (in, out) fp64, ``nn.Linear.reset_parameters`` on that shape;
  forward ReLU(X W).
- ``MiNbaseNet.fit`` (inc_net.py L129-148): recursive least squares per batch, new class columns appended as zeros,
  absent classes' targets zero-padded; R_0 = I / gamma (L90-92).
- ``PiNoise.forward`` (MiN/backbones/ViT_MiN.py L137-154): MLP(h) + [sum_i (mu_i(h W_down) + sigma_i(h W_down)) w_i]
  W_up + h.
- ``PiNoise.init_weight_noise`` (ViT_MiN.py L112-128): zeros while fewer than two prototypes, else softmax of
  [cos(p_last, p_i) for each prototype] + [1 for the newest generator].
- ``MinNet.run``'s loss for t > 0 (MiN/models/MiN.py L270-277): CE(analytic logits + W_aux h, y).
- The paper's Eq. 8-9 (sampled noise eps_t = eps * sigma_t + mu_t) and Eq. 11-12 (omega = softmax(cos / tau)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def random_buffer(in_features: int, buffer_size: int, generator: torch.Generator) -> torch.Tensor:
    """RandomBuffer's weight: torch.empty((in, out), double) then nn.Linear.reset_parameters, i.e.
    kaiming_uniform_(W, a=sqrt(5)), whose fan_in is W.size(1) = out: bound = gain * sqrt(3 / fan_in) with gain =
    sqrt(2 / (1 + a^2))."""
    w = torch.empty(in_features, buffer_size, dtype=torch.float64)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
    return w


class RecursiveLeastSquares:
    """MiNbaseNet's analytic classifier: ``weight`` (M x classes so far) and ``R`` (M x M), fp64."""

    def __init__(self, buffer_size: int, gamma: float) -> None:
        self.weight = torch.zeros(buffer_size, 0, dtype=torch.float64)
        self.R = torch.eye(buffer_size, dtype=torch.float64) / gamma

    def fit(self, X: torch.Tensor, Y: torch.Tensor) -> None:
        """One batch: X the buffer's features (B x M), Y = one_hot(targets) (its width the batch's largest label + 1,
        as ``torch.nn.functional.one_hot(targets)`` without num_classes gives it)."""
        X, Y = X.to(self.weight), Y.to(self.weight)
        num_targets = Y.shape[1]
        out_features = self.weight.shape[1]
        if num_targets > out_features:
            tail = torch.zeros((self.weight.shape[0], num_targets - out_features)).to(self.weight)
            self.weight = torch.cat((self.weight, tail), dim=1)
        elif num_targets < out_features:
            tail = torch.zeros((Y.shape[0], out_features - num_targets)).to(Y)
            Y = torch.cat((Y, tail), dim=1)
        K = torch.inverse(torch.eye(X.shape[0]).to(X) + X @ self.R @ X.T)
        self.R -= self.R @ X.T @ K @ X @ self.R
        self.weight += self.R @ X.T @ (Y - X @ self.weight)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """``forward_fc``: features @ weight."""
        return X.to(self.weight) @ self.weight


def pinoise_forward(
    h: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    *,
    mu: list[nn.Linear],
    sigma: list[nn.Linear],
    weight_noise: torch.Tensor,
    mlp: nn.Linear | None = None,
) -> torch.Tensor:
    """PiNoise.forward (a layer built with the MLP; ``mlp=None`` stands for the MLP at its zero initialisation)."""
    x1 = mlp(h) if mlp is not None else torch.zeros_like(h)
    x_down = h @ w_down
    noise = None
    for i in range(len(mu)):
        m = mu[i](x_down)
        s = sigma[i](x_down)
        if noise is None:
            noise = (m + s) * weight_noise[i]
        else:
            noise += (m + s) * weight_noise[i]
    noise = noise @ w_up
    return x1 + noise + h


def paper_noise(
    h: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    *,
    mu: list[nn.Linear],
    sigma: list[nn.Linear],
    omega: torch.Tensor,
    eps: torch.Tensor,
) -> torch.Tensor:
    """Eq. 9, 10, 13: r + (sum_t omega_t (eps * phi_sigma_t(r W_down) + phi_mu_t(r W_down))) W_up, one signal eps."""
    r_down = h @ w_down
    mixture = sum(omega[t] * (eps * sigma[t](r_down) + mu[t](r_down)) for t in range(len(mu)))
    return h + mixture @ w_up


def init_weight_noise(prototypes: list[torch.Tensor], generators: int) -> torch.Tensor:
    """PiNoise.init_weight_noise, called by update_noise after the new generator was appended and before the task's
    prototype is (``prototypes`` are the earlier tasks')."""
    if len(prototypes) <= 1:
        return torch.zeros(generators)
    weight = torch.ones(generators)
    for i in range(len(prototypes)):
        mu_t = prototypes[-1]
        mu_i = prototypes[i]
        s_i = torch.dot(mu_t, mu_i) / (torch.norm(mu_t) * torch.norm(mu_i))
        weight[i] = s_i.detach().clone()
    return torch.softmax(weight, dim=-1)


def paper_omega(prototypes: list[torch.Tensor], tau: float) -> torch.Tensor:
    """Eq. 11-12 at task t = len(prototypes) - 1: w_i = exp(s_{t,i} / tau) / sum_j exp(s_{t,j} / tau)."""
    mu_t = prototypes[-1]
    s = torch.stack([torch.dot(mu_t, mu_i) / (mu_t.norm() * mu_i.norm()) for mu_i in prototypes])
    return torch.exp(s / tau) / torch.exp(s / tau).sum()


def residual_loss(analytic_logits: torch.Tensor, aux: nn.Linear, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """run() for cur_task > 0: logits2 = normal_fc(h) + logits1 (logits1 without gradient); CE."""
    return F.cross_entropy(aux(h) + analytic_logits.detach(), y.long())
