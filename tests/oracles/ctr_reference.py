"""An independent, plain-PyTorch transcription ("oracle") of CTR's CL-plugin (KSM + TSM) and its HAT training rules.

Written from the official sources only, for use as a test reference (ZixuanKe/PyContinual @ 25a859b):

* src/networks/base/adapters.py: ``BertAdapterCapsuleMaskImp.forward`` (100-124), ``BertAdapterMask.mask`` (64-72),
  ``CapsNetImp.forward`` (141-149), ``CapsuleLayerImp.__init__`` ('transfer_route', 212-259) and ``.forward``
  ('semantic' 265-275, 'transfer_route' 277-337), ``CapsuleLayerImp.squash`` (402-406).
* src/networks/classification/bert_adapter_capsule_mask.py: ``Net.mask`` (84-108), ``Net.get_view_for`` (111-151),
  ``Net.get_view_for_tsv`` (153-230).
* src/approaches/classification/bert_adapter_capsule_mask.py: ``Appr.train`` (mask_pre/mask_back, 87-104),
  ``Appr.train_epoch`` (s annealing, gradient masks, compensation, clamp; 109-160).
* src/approaches/base/bert_adapter_mask_base.py: ``Appr.__init__`` (smax 400, thres_cosh 50, thres_emb 6, lamb 0.75,
  ``tsv_para``), ``Appr.hat_criterion_adapter`` (269-288).
* src/load_base_args.py (baseline 'ctr': transfer_route, apply_one_layer_shared, larger_as_share, use_imp, ReLU).

Where the code ``.view``s non-permuted tensors (adapters.py:279, 290, 298, 319-322, 326; they mix the task / capsule /
token / batch axes), this module follows the paper's structure with explicit permutes: every sample and token keeps its
own capsules, a_i and delta_i are per (sample, task) and broadcast over tokens. The task capsules are squashed per
capsule vector (the 3 semantic dims; the code squashes over the task axis, adapters.py:273).

Layout conventions (T tasks, J = 3 transfer capsules, S = 3 semantic dims, C conv channels (100 in the code)):

* capsules ``caps[b, n, i, c]`` = squash(caps_w[i] z[b, n] + caps_b[i]) over c.
* pre-route ``u[b, n, i, j, k] = sum_c caps[b, n, i, c] * route_w[j, i, c, k]`` (the code's ``x @ route_weights``, i.e.
  a row vector times W_{j,i}: u_{j|i} = W_{j,i}^T p_i in column notation).
* a 9-vector per (token, task) is ``u[b, n, i].reshape(9)`` (j-major: index j * 3 + k); a_i reshapes the same way,
  and the routed v[b, n] (J, S) flattens j-major before the KS-layer ``larger``.

Parameter dict ``p`` (tensors; keys are this module's, official names in brackets; C = 100 in the code):

* caps_w (T, 3, d), caps_b (T, 3): task capsule Linear d->3 per task [semantic_capsules.fc1[i]].
* route_w (3, T, 3, 3): indexed [j, i, c_in, k_out] [transfer_capsules.route_weights].
* cur_conv_w{K} (C, 9, K), cur_conv_b{K} (C,), K in 3, 4, 5: current-task branch Conv1d, padding K - 2 [convs3].
* task_conv_w{K} (C, 9, K), task_conv_b{K} (C,): per-task branch Conv1d, no padding [convs2].
* fc_cur_w (C, 3C), fc_cur_b (C,) [fc_cur]; fc_sim_w (9, 3C), fc_sim_b (9,) [fc_sim].
* gate_w (2, 3C) or (2, 3C, 1), gate_b (2,): Conv1d(3C, 2, 1) on a length-1 sequence [convs4].
* larger_w (d, 9), larger_b (d,): shared KS-layer [transfer_capsules.larger] (larger_as_share).
* fc1_w (r, d), fc1_b (r,), fc2_w (d, r), fc2_b (d,): TSM [fc1, fc2]; e1 (T, r), e2 (T, d): HAT embeddings [efc1, efc2].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KERNELS = (3, 4, 5)  # adapters.py:217 (Ks = [3, 4, 5])
SQUASH_EPS = 1e-16  # adapters.py:402
GUMBEL_TAU = 1.0  # adapters.py:310 (F.gumbel_softmax default tau)
S_MAX = 400.0  # bert_adapter_mask_base.py:75
THRES_COSH = 50.0  # bert_adapter_mask_base.py:76
THRES_EMB = 6.0  # bert_adapter_mask_base.py:77 (e clamped to [-6, 6] after each step)
LAMB = 0.75  # bert_adapter_mask_base.py:78


def squash(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """adapters.py:CapsuleLayerImp.squash (402-406): n = |v|^2 + 1e-16; n / (1 + n) * v / sqrt(n)."""
    sq = (v**2).sum(dim=dim, keepdim=True) + SQUASH_EPS
    return sq / (1 + sq) * v / torch.sqrt(sq)


def task_capsules(z: torch.Tensor, p: dict) -> torch.Tensor:
    """TK-layer, adapters.py:CapsuleLayerImp.forward 'semantic' (268-273): one Linear d->3 per task, all tasks.

    z (B, N, d) -> (B, N, T, 3), squashed over the 3 capsule dims of each task (the code squashes over T, see module doc).
    """
    B, N, _ = z.shape
    T, S, d = p["caps_w"].shape
    out = F.linear(z, p["caps_w"].reshape(T * S, d), p["caps_b"].reshape(T * S))
    return squash(out.view(B, N, T, S), dim=-1)


def pre_route(caps: torch.Tensor, p: dict) -> torch.Tensor:
    """Pre-route vectors, adapters.py:281 (``x[None, :, :, None, :] @ route_weights[:, None]``).

    caps (B, N, T, 3) -> u (B, N, T, J, 3), u[..., i, j, k] = sum_c caps[..., i, c] * route_w[j, i, c, k].
    """
    return torch.einsum("bnic,jick->bnijk", caps, p["route_w"])


def _hard_gumbel(logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """One-hot gate over the last axis of logits.

    noise given: torch F.gumbel_softmax(hard=True, tau=1) with explicit Gumbel samples (adapters.py:310):
    y_soft = softmax((logits + noise) / tau); y_hard - y_soft.detach() + y_soft (straight-through).
    noise None: eval rule (clbench's choice; the code samples noise at eval too): one-hot argmax of logits, no grad.
    """
    if noise is None:
        idx = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, idx, 1.0).detach()
    y_soft = torch.softmax((logits + noise) / GUMBEL_TAU, dim=-1)
    idx = y_soft.argmax(dim=-1, keepdim=True)
    y_hard = torch.zeros_like(logits).scatter_(-1, idx, 1.0)
    return y_hard - y_soft.detach() + y_soft


def similarity(u: torch.Tensor, t: int, p: dict, gate_noise: torch.Tensor | None = None):
    """Similarity estimator, adapters.py:CapsuleLayerImp.forward 'transfer_route' (287-315), for all T tasks.

    u (B, N, T, J, 3). Current task: cur = cat_K maxpool_N(ReLU(Conv1d_K^{cur, pad K-2}(u_t))) (B, 3C) (290-295);
    task i: z_i = cat_K maxpool_N(ReLU(Conv1d_K^{task}(u_i) + fc_cur(cur))) (B, 3C) (298-306); a_i = fc_sim(z_i) (307);
    logits_i = convs4(z_i) (308); delta_i = hard_gumbel(logits_i)[0] (310-312). gate_noise: None (eval, argmax) or
    (B, T, 2) Gumbel samples (training). Returns a (B, T, 9) and delta (B, T).
    """
    B, N, T = u.shape[:3]
    f = u.reshape(B, N, T, -1).permute(0, 2, 3, 1)  # (B, T, 9, N), tokens on the conv axis
    cur = f[:, t]
    cur_feats = []
    for K in KERNELS:
        h = F.relu(F.conv1d(cur, p[f"cur_conv_w{K}"], p[f"cur_conv_b{K}"], padding=K - 2))
        cur_feats.append(F.max_pool1d(h, h.size(2)).squeeze(2))
    mix = F.linear(torch.cat(cur_feats, 1), p["fc_cur_w"], p["fc_cur_b"])  # (B, C)
    ft = f.reshape(B * T, f.shape[2], N)
    mix_t = mix.unsqueeze(1).expand(B, T, mix.shape[1]).reshape(B * T, -1, 1)
    feats = []
    for K in KERNELS:
        h = F.relu(F.conv1d(ft, p[f"task_conv_w{K}"], p[f"task_conv_b{K}"]) + mix_t)
        feats.append(F.max_pool1d(h, h.size(2)).squeeze(2))
    zi = torch.cat(feats, 1).view(B, T, -1)  # (B, T, 3C)
    a = F.linear(zi, p["fc_sim_w"], p["fc_sim_b"])  # (B, T, 9)
    logits = F.linear(zi, p["gate_w"].reshape(2, -1), p["gate_b"])  # (B, T, 2)
    delta = _hard_gumbel(logits, gate_noise)[..., 0]
    return a, delta


def tsv_grad_mask(t: int, T: int) -> torch.Tensor:
    """Row t of tril(ones(T, T)) (adapters.py:259): routing weight in the forward (318) and the factor on the gradients
    of caps_w[i], caps_b[i] and route_w[:, i] (get_view_for_tsv; applied only when t > 0, train_epoch:132-137).

    Code note: ``tsv_para`` names ``capsule_net.tsv_capsules.route_weights`` (an unused parameter), not the routing's
    ``transfer_capsules.route_weights``, so the code never masks route_w's gradient (METHODS.md 9.D.3 says it does)."""
    return torch.tril(torch.ones(T, T))[t]


def ksm(z: torch.Tensor, t: int, p: dict, gate_noise: torch.Tensor | None = None) -> torch.Tensor:
    """KSM, CapsNetImp.forward (141-149) + 'transfer_route' routing (318-331).

    v[b, n] = sum_i tsv[t, i] * a[b, i] (as J x 3) * delta[b, i] * u[b, n, i] (J x 3); out = larger(v flattened j-major).
    z (B, N, d) -> (B, N, d).
    """
    B, N, _ = z.shape
    u = pre_route(task_capsules(z, p), p)  # (B, N, T, J, 3)
    T, J, S = u.shape[2:]
    a, delta = similarity(u, t, p, gate_noise)
    tsv = tsv_grad_mask(t, T).to(dtype=u.dtype, device=u.device)
    w = (tsv.view(1, T, 1) * a * delta.unsqueeze(-1)).view(B, 1, T, J, S)
    v = (w * u).sum(dim=2)  # (B, N, J, S)
    return F.linear(v.reshape(B, N, J * S), p["larger_w"], p["larger_b"])


def hat_gates(p: dict, t: int, s: float):
    """BertAdapterMask.mask (64-72): g1 = sigmoid(s * e1[t]) (r,), g2 = sigmoid(s * e2[t]) (d,)."""
    return torch.sigmoid(s * p["e1"][t]), torch.sigmoid(s * p["e2"][t])


def plugin(z: torch.Tensor, t: int, p: dict, s: float, gate_noise: torch.Tensor | None = None) -> torch.Tensor:
    """CL-plugin, BertAdapterCapsuleMaskImp.forward (100-124), ReLU branch (use_gelu off for ctr):

    h = z + KSM(z) (105); h = ReLU(fc1(h)) * g1 (118-119); h = ReLU(fc2(h)) * g2 (121-122); return z + h (124).
    """
    g1, g2 = hat_gates(p, t, s)
    h = z + ksm(z, t, p, gate_noise)
    h = F.relu(F.linear(h, p["fc1_w"], p["fc1_b"])) * g1
    h = F.relu(F.linear(h, p["fc2_w"], p["fc2_b"])) * g2
    return z + h


def grad_masks(g1_prev: torch.Tensor, g2_prev: torch.Tensor) -> dict:
    """HAT backward masks, Net.get_view_for (111-131) as 1 - vals (Appr.train:101-104), applied for t > 0.

    g1_prev (r,) / g2_prev (d,): cumulative elementwise max of earlier tasks' gates at s_max (Appr.train:92-97); a 2-D
    input (k, r) / (k, d) is a stack of earlier tasks' gates and is max-reduced here. Returns multipliers with keys
    fc1_w (r, d) rows 1 - g1; fc1_b 1 - g1; fc2_w (d, r) 1 - min(g2_row, g1_col); fc2_b 1 - g2.
    """
    g1 = g1_prev.amax(0) if g1_prev.dim() == 2 else g1_prev
    g2 = g2_prev.amax(0) if g2_prev.dim() == 2 else g2_prev
    r, d = g1.numel(), g2.numel()
    return {
        "fc1_w": 1 - g1.view(-1, 1).expand(r, d),
        "fc1_b": 1 - g1.view(-1),
        "fc2_w": 1 - torch.min(g2.view(-1, 1).expand(d, r), g1.view(1, -1).expand(d, r)),
        "fc2_b": 1 - g2.view(-1),
    }


def ks_gate(e3: torch.Tensor, t: int, s: float) -> torch.Tensor:
    """The KS-layer's gate, CapsuleLayerImp.mask (adapters.py:389-391): sigmoid(s * elarger[t]) (d,). Net.mask (84-108)
    returns it with g1, g2 under the key ``...tsv_capsules.larger``, so it enters the capacity regulariser
    (hat_criterion_adapter iterates over every mask) and the cumulative max; with larger_as_share the forward
    (adapters.py:328-331) never multiplies by it. Its embedding's name contains ``tsv_capsules.e``, so it is compensated
    and clamped (Appr.train_epoch 141, 156)."""
    return torch.sigmoid(s * e3[t])


def ks_grad_masks(g3_prev: torch.Tensor, inputs: int) -> dict:
    """Net.get_view_for (133-150) for ``tsv_capsules.larger``: the KS-layer's weight (d, inputs) rows and its bias are
    multiplied by 1 - g3_prev, the cumulative KS-layer gate of earlier tasks."""
    return {"larger_w": 1 - g3_prev.view(-1, 1).expand(-1, inputs), "larger_b": 1 - g3_prev.view(-1)}


def compensation(
    grad_e: torch.Tensor, e: torch.Tensor, s: float, s_max: float = S_MAX, clamp: float = THRES_COSH
) -> torch.Tensor:
    """Embedding-gradient compensation, Appr.train_epoch (139-144), every t (also t = 0):

    grad * s_max / s * (cosh(clamp(s * e, +-clamp)) + 1) / (cosh(e) + 1).
    """
    num = torch.cosh(torch.clamp(s * e, -clamp, clamp)) + 1
    den = torch.cosh(e) + 1
    return grad_e * (s_max / s) * num / den


def capacity_regulariser(gates, prev_gates=None) -> torch.Tensor:
    """HAT regulariser, Appr.hat_criterion_adapter (bert_adapter_mask_base.py:269-288), one ratio over all gates:

    prev_gates None (task 0): sum(g) / #g; else sum(g * (1 - g_prev)) / sum(1 - g_prev), g_prev the cumulative max.
    gates / prev_gates: sequences of tensors in the same order. The loss adds LAMB * this.
    """
    if prev_gates is None:
        return sum(g.sum() for g in gates) / sum(g.numel() for g in gates)
    num = sum((g * (1 - gp)).sum() for g, gp in zip(gates, prev_gates, strict=True))
    den = sum((1 - gp).sum() for gp in prev_gates)
    return num / den


def anneal(step: int, num_batches: int, s_max: float = S_MAX) -> float:
    """Appr.train_epoch (111, 116): s = (s_max - 1/s_max) * step / len(loader) + 1/s_max, step = enumerate index (0-based,
    restarting every epoch), so s runs from 1/s_max to just below s_max; eval and masks use s_max."""
    return (s_max - 1 / s_max) * step / num_batches + 1 / s_max


def _make_params(T: int, d: int, r: int, C: int = 5, gen: torch.Generator | None = None) -> dict:
    def rnd(*shape, scale=0.5):
        return scale * torch.randn(*shape, generator=gen)

    p = {
        "caps_w": rnd(T, 3, d),
        "caps_b": rnd(T, 3),
        "route_w": rnd(3, T, 3, 3, scale=1.0),
        "fc_cur_w": rnd(C, 3 * C),
        "fc_cur_b": rnd(C),
        "fc_sim_w": rnd(9, 3 * C),
        "fc_sim_b": rnd(9),
        "gate_w": rnd(2, 3 * C, 1),
        "gate_b": rnd(2),
        "larger_w": rnd(d, 9),
        "larger_b": rnd(d),
        "fc1_w": rnd(r, d),
        "fc1_b": rnd(r),
        "fc2_w": rnd(d, r),
        "fc2_b": rnd(d),
        "e1": rnd(T, r, scale=1.0),
        "e2": rnd(T, d, scale=1.0),
    }
    for K in KERNELS:
        p[f"cur_conv_w{K}"] = rnd(C, 9, K)
        p[f"cur_conv_b{K}"] = rnd(C)
        p[f"task_conv_w{K}"] = rnd(C, 9, K)
        p[f"task_conv_b{K}"] = rnd(C)
    return p


if __name__ == "__main__":
    import time

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    B, N, d, T, r = 2, 6, 8, 3, 4
    p = _make_params(T, d, r, gen=gen)
    z = torch.randn(B, N, d, generator=gen)
    noise = -torch.empty(B, T, 2).exponential_(generator=gen).log()

    # squash: |out| = n / (1 + n) (n = |v|^2), zero stays zero.
    v = torch.randn(5, 3, generator=gen)
    n2 = (v**2).sum(-1)
    assert torch.allclose(squash(v).norm(dim=-1), n2 / (1 + n2), atol=1e-6)
    assert torch.equal(squash(torch.zeros(2, 3)), torch.zeros(2, 3))

    # shapes
    caps = task_capsules(z, p)
    u = pre_route(caps, p)
    a, delta = similarity(u, 1, p)
    assert caps.shape == (B, N, T, 3) and u.shape == (B, N, T, 3, 3), (caps.shape, u.shape)
    assert a.shape == (B, T, 9) and delta.shape == (B, T)
    assert ((delta == 0) | (delta == 1)).all()
    assert ksm(z, 1, p).shape == (B, N, d) and plugin(z, 1, p, S_MAX).shape == (B, N, d)

    # training gate = torch F.gumbel_softmax(hard=True) with the same Gumbel draws (forward and straight-through grad).
    lg = torch.randn(B, T, 2, generator=gen, requires_grad=True)
    torch.manual_seed(1)
    gn = -torch.empty_like(lg).exponential_().log()
    torch.manual_seed(1)
    ref = F.gumbel_softmax(lg, tau=GUMBEL_TAU, hard=True)
    mine = _hard_gumbel(lg, gn)
    assert torch.equal(mine, ref)
    (ga,) = torch.autograd.grad((mine[..., 0] * torch.arange(1.0, 7.0).view(B, T)).sum(), lg)
    (gb,) = torch.autograd.grad((ref[..., 0] * torch.arange(1.0, 7.0).view(B, T)).sum(), lg)
    assert torch.allclose(ga, gb) and ga.abs().sum() > 0
    assert torch.equal(_hard_gumbel(torch.tensor([[2.0, 1.0], [0.0, 3.0]]), None)[:, 0], torch.tensor([1.0, 0.0]))

    # future tasks (i > t) have no effect on ksm / plugin (eval and training gates), and get exactly zero gradient.
    t = 1
    q = dict(p)
    q["caps_w"] = p["caps_w"].clone()
    q["caps_b"] = p["caps_b"].clone()
    q["route_w"] = p["route_w"].clone()
    q["caps_w"][t + 1 :] = 5.0 * torch.randn(T - t - 1, 3, d, generator=gen)
    q["caps_b"][t + 1 :] = 3.0
    q["route_w"][:, t + 1 :] = -2.0
    for gnz in (None, noise):
        assert torch.equal(ksm(z, t, p, gnz), ksm(z, t, q, gnz))
        assert torch.equal(plugin(z, t, p, 7.0, gnz), plugin(z, t, q, 7.0, gnz))
    pg = {k: x.clone().requires_grad_() for k, x in p.items()}
    plugin(z, t, pg, 7.0, noise).square().sum().backward()
    assert torch.equal(pg["caps_w"].grad[t + 1 :], torch.zeros(T - t - 1, 3, d))
    assert torch.equal(pg["route_w"].grad[:, t + 1 :], torch.zeros(3, T - t - 1, 3, 3))
    assert pg["caps_w"].grad[: t + 1].abs().sum() > 0 and pg["route_w"].grad[:, : t + 1].abs().sum() > 0
    assert torch.equal(tsv_grad_mask(0, 3), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(tsv_grad_mask(2, 3), torch.ones(3))

    # gates saturate at s = 400 with e = +-6
    sat = {"e1": 6.0 * torch.tensor([[1.0, -1, 1, -1], [-1, 1, 1, -1]]), "e2": 6.0 * torch.sign(torch.randn(2, d))}
    g1a, g2a = hat_gates(sat, 0, S_MAX)
    g1b, g2b = hat_gates(sat, 1, S_MAX)
    assert torch.equal(g1a, (sat["e1"][0] > 0).float()) and torch.equal(g2b, (sat["e2"][1] > 0).float())

    # grad masks: cumulative max of tasks 0, 1 zeroes exactly the protected entries
    m = grad_masks(torch.stack([g1a, g1b]), torch.stack([g2a, g2b]))
    g1c, g2c = torch.max(g1a, g1b), torch.max(g2a, g2b)
    assert torch.equal(g1c, torch.tensor([1.0, 1, 1, 0]))
    assert torch.equal(m["fc1_w"], (1 - g1c).view(-1, 1).expand(r, d)) and torch.equal(m["fc1_b"], 1 - g1c)
    prot2 = (g2c.view(-1, 1) == 1) & (g1c.view(1, -1) == 1)
    assert torch.equal(m["fc2_w"] == 0, prot2) and torch.equal(m["fc2_w"] == 1, ~prot2)
    assert torch.equal(m["fc2_b"], 1 - g2c)
    ph = {k: x.clone().requires_grad_() for k, x in p.items()}
    plugin(z, 2, ph, 3.0, noise).square().sum().backward()
    for k in ("fc1_w", "fc1_b", "fc2_w", "fc2_b"):
        gm = ph[k].grad * m[k]
        assert torch.equal(gm[m[k] == 0], torch.zeros(int((m[k] == 0).sum()))), k
        assert gm[m[k] == 1].abs().sum() > 0, k

    # compensation, regulariser, annealing
    e = torch.tensor([0.0, 0.5, -6.0])
    c = compensation(torch.ones(3), e, 2.0, S_MAX)
    assert torch.allclose(c[0], torch.tensor(S_MAX / 2.0))
    assert torch.allclose(c[2], S_MAX / 2.0 * (math.cosh(12.0) + 1) / (math.cosh(6.0) + 1) * torch.ones(()))
    assert torch.allclose(
        compensation(torch.ones(1), torch.tensor([6.0]), 100.0),
        torch.tensor([4.0 * (math.cosh(50) + 1) / (math.cosh(6) + 1)]),
    )
    gs = [torch.tensor([0.2, 0.4]), torch.tensor([1.0, 0.0, 0.5])]
    assert torch.allclose(capacity_regulariser(gs), torch.tensor(2.1 / 5))
    gp = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0, 0.5])]
    assert torch.allclose(capacity_regulariser(gs, gp), torch.tensor((0.4 + 1.0 + 0.25) / 2.5))
    assert anneal(0, 10) == 1 / S_MAX and abs(anneal(10, 10) - S_MAX) < 1e-9 and anneal(9, 10) < S_MAX

    print(f"ctr_reference self-check OK ({time.perf_counter() - t0:.3f}s)")
