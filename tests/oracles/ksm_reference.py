"""An independent, plain-PyTorch reference ("oracle") of clbench's KSM (Kernel-wise Soft Mask) reconstruction.

KSM's equations (Eq. 4-8) could not be read (METHODS.md §9.B); this module transcribes the reconstruction fixed for
clbench, not the paper. For a real mask M^r (one value per kernel), temperature T > 0, scale alpha and the initial
value m0 of M^r:

    p   = sigmoid(M^r)                          ("Eq. 6")
    M^b = softmax([p, 1 - p] / T)[0]            ("Eq. 8", two-way softmax, component 0; = sigmoid((2p - 1) / T))
    A^s = alpha * (p - sigmoid(m0)) * M^b       ("Eq. 5", reconstruction)
    M   = M^b + A^s                             ("Eq. 4")

Kernels: a Linear weight W (out, in) with group size g | in has M^r of shape (out, in / g), each value repeated over g
consecutive input columns (g = 1: element-wise); a Conv2d weight (c_out, c_in, k, k) has M^r of shape (c_out, c_in),
broadcast over the k x k kernel. The task weight is W_t = W * expand(M). The gradient reaches M^r through the
sigmoid and the softmax, with no straight-through estimator (:func:`mask_grad`).
"""

from __future__ import annotations

import torch


def _c0(m0, ref: torch.Tensor) -> torch.Tensor:
    """sigmoid(m0) as a tensor of ref's dtype and device (m0: a number or a tensor broadcastable to ref)."""
    return torch.sigmoid(torch.as_tensor(m0, dtype=ref.dtype, device=ref.device))


def binary_part(mr: torch.Tensor, temperature: float) -> torch.Tensor:
    """M^b = softmax([p, 1 - p] / T)[0] with p = sigmoid(M^r), the softmax over a new last axis of size 2."""
    assert temperature > 0, temperature
    p = torch.sigmoid(mr)
    return torch.softmax(torch.stack([p, 1 - p], dim=-1) / temperature, dim=-1)[..., 0]


def scale_part(mr: torch.Tensor, temperature: float, alpha: float, m0) -> torch.Tensor:
    """A^s = alpha * (sigmoid(M^r) - sigmoid(m0)) * M^b."""
    return alpha * (torch.sigmoid(mr) - _c0(m0, mr)) * binary_part(mr, temperature)


def soft_mask(mr: torch.Tensor, temperature: float, alpha: float, m0) -> torch.Tensor:
    """M = M^b + A^s, the same shape as M^r."""
    return binary_part(mr, temperature) + scale_part(mr, temperature, alpha, m0)


def linear_weight(W: torch.Tensor, mr: torch.Tensor, group: int, temperature: float, alpha: float, m0) -> torch.Tensor:  # noqa: PLR0917
    """W_t = W * M repeated ``group`` times along the input axis. W (out, in); M^r (out, in // group)."""
    out_f, in_f = W.shape
    assert in_f % group == 0 and mr.shape == (out_f, in_f // group), (W.shape, mr.shape, group)
    return W * soft_mask(mr, temperature, alpha, m0).repeat_interleave(group, dim=1)


def conv_weight(W: torch.Tensor, mr: torch.Tensor, temperature: float, alpha: float, m0) -> torch.Tensor:
    """W_t = W * M[:, :, None, None]. W (c_out, c_in, k, k); M^r (c_out, c_in): one value per kernel."""
    assert W.dim() == 4 and mr.shape == W.shape[:2], (W.shape, mr.shape)
    return W * soft_mask(mr, temperature, alpha, m0)[:, :, None, None]


def mask_grad(mr: torch.Tensor, grad_M: torch.Tensor, temperature: float, alpha: float, m0) -> torch.Tensor:
    """dL/dM^r from dL/dM, by hand (element-wise, no autograd, no straight-through estimator).

    With p = sigmoid(M^r), c = sigmoid(m0), M^b = softmax([p, 1 - p] / T)[0] = sigmoid((2p - 1) / T), so that
    dp/dM^r = p (1 - p) and dM^b/dp = (2 / T) M^b (1 - M^b), and M = M^b (1 + alpha (p - c)):

        dM/dp   = (2 / T) M^b (1 - M^b) (1 + alpha (p - c)) + alpha M^b
        dL/dM^r = dL/dM * p (1 - p) * [(2 / T) M^b (1 - M^b) (1 + alpha (p - c)) + alpha M^b]

    m0 is a constant (no gradient). For a grouped Linear / a Conv2d, dL/dM is the sum over each kernel of
    dL/dW_t * W (the caller reduces it before calling this).
    """
    p = torch.sigmoid(mr)
    c = _c0(m0, mr)
    mb = binary_part(mr, temperature)
    dM_dp = (2.0 / temperature) * mb * (1 - mb) * (1 + alpha * (p - c)) + alpha * mb
    return grad_M * p * (1 - p) * dM_dp


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    dt = torch.float64

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=dt) * scale

    # Hand-derived gradient == autograd (float64), over several temperatures, scales and initial values.
    for T, alpha, m0 in [(1.0, 0.5, 0.0), (0.2, 2.0, 1.5), (0.05, 1.0, 3.0), (3.0, 0.0, -1.0)]:
        mr = (r(7, 9, scale=2.0) + m0).requires_grad_(True)
        gm = r(7, 9)
        (auto,) = torch.autograd.grad(soft_mask(mr, T, alpha, m0), mr, gm)
        hand = mask_grad(mr.detach(), gm, T, alpha, m0)
        assert torch.allclose(hand, auto, rtol=0, atol=1e-10), (T, alpha, m0, (hand - auto).abs().max())
        assert torch.isfinite(auto).all() and auto.abs().sum() > 0

    # The same through the kernel expansion: dL/dM^r = mask_grad(sum over each kernel of dL/dW_t * W).
    T, alpha, m0 = 0.5, 1.0, 2.0
    W, mr = r(6, 12), (r(6, 3) + m0).requires_grad_(True)
    g_lin = r(6, 12)
    (auto,) = torch.autograd.grad(linear_weight(W, mr, 4, T, alpha, m0), mr, g_lin)
    hand = mask_grad(mr.detach(), (g_lin * W).reshape(6, 3, 4).sum(-1), T, alpha, m0)
    assert torch.allclose(hand, auto, rtol=0, atol=1e-10)
    Wc, mrc = r(4, 3, 5, 5), (r(4, 3) + m0).requires_grad_(True)
    g_conv = r(4, 3, 5, 5)
    (auto,) = torch.autograd.grad(conv_weight(Wc, mrc, T, alpha, m0), mrc, g_conv)
    hand = mask_grad(mrc.detach(), (g_conv * Wc).sum((-2, -1)), T, alpha, m0)
    assert torch.allclose(hand, auto, rtol=0, atol=1e-10)

    # M^b in (0, 1), = sigmoid((2p - 1) / T), and -> {0, 1} (the side of p = 1/2) as T -> 0.
    mr = r(1000, scale=3.0)
    mb = binary_part(mr, 1.0)
    assert ((mb > 0) & (mb < 1)).all()
    assert torch.allclose(mb, torch.sigmoid((2 * torch.sigmoid(mr) - 1) / 1.0), atol=1e-14)
    mr = mr[mr.abs() > 0.1]
    for T in (1e-1, 1e-2, 1e-3):
        err = (binary_part(mr, T) - (mr > 0).to(dt)).abs().max()
        assert err < {1e-1: 0.5, 1e-2: 1e-2, 1e-3: 1e-20}[T], (T, err)

    # At M^r = m0: A^s = 0 exactly, so M = M^b = 1 - (M^b's deviation from 1).
    m0 = 4.0
    mr = torch.full((3, 5), m0, dtype=dt)
    assert torch.equal(scale_part(mr, 0.1, 2.0, m0), torch.zeros_like(mr))
    assert torch.equal(soft_mask(mr, 0.1, 2.0, m0), binary_part(mr, 0.1))
    dev = 1 - torch.sigmoid((2 * torch.sigmoid(torch.tensor(m0, dtype=dt)) - 1) / 0.1)  # 1 - M^b, about 6.5e-5
    assert torch.allclose(1 - soft_mask(mr, 0.1, 2.0, m0), dev.expand(3, 5), rtol=1e-12, atol=0) and dev < 1e-4

    # group 1 is element-wise W * M; conv broadcasts one value per kernel.
    W, mr = r(5, 8), r(5, 8)
    assert torch.equal(linear_weight(W, mr, 1, 0.3, 1.5, 0.5), W * soft_mask(mr, 0.3, 1.5, 0.5))
    Wc, mrc = r(2, 3, 4, 4), r(2, 3)
    Wt = conv_weight(Wc, mrc, 0.3, 1.5, 0.5)
    M = soft_mask(mrc, 0.3, 1.5, 0.5)
    assert all(torch.equal(Wt[o, i], Wc[o, i] * M[o, i]) for o in range(2) for i in range(3))
    print("ksm_reference self-check OK")
