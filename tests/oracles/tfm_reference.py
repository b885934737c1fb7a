"""An independent, plain-PyTorch reference ("oracle") of clbench's TFM (Ternary Feature Masks), ViT option G.

TFM's method section could not be read (METHODS.md §9.A); this module transcribes the reconstruction fixed for clbench
(METHODS.md §9.A.2 and §9.A.4, option G), not the paper's equations:

* one pre-norm timm ViT block, ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``, written from scratch with
  ``torch.nn.functional`` (LayerNorm eps 1e-6; timm ``Attention``: fused qkv Linear d -> 3d reshaped (B, N, 3, H, d/H),
  softmax(q k^T / sqrt(d/H)) v, proj Linear d -> d; timm ``Mlp``: fc1 d -> 4d, exact (erf) GELU, fc2 4d -> d);
* task-specific normalisation: task s uses its own LayerNorm affine (weight, bias) in norm1 and norm2 (and in the final
  norm, which the caller applies, e.g. with :func:`layer_norm`); the per-token statistics are shared;
* growth: task j appends n_j MLP units (fc1 rows ``W1_j`` (n_j, d), bias ``b1_j`` (n_j,), fc2 columns ``W2_j`` (d, n_j));
* ternary unit states for task s over the units that exist after task s (pretrained units first, then task 0's,
  task 1's, ..., task s's): 0 = not used by s, 1 = used by s and learned before s (frozen), 2 = new for s (trained by s).
  The mask bit of a unit is ``state != 0``; it multiplies the unit's GELU output.

Units grown by tasks after s are never read by the task-s forward, so task s's output is bit-identical whatever they
hold.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LN_EPS = 1e-6


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """timm ``nn.LayerNorm(d, eps=1e-6)`` over the last axis with the given (task-specific) affine."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, LN_EPS)


def attention(x: torch.Tensor, qkv_w, qkv_b, proj_w, proj_b, *, num_heads: int) -> torch.Tensor:
    """timm ``Attention`` (no q/k norm, no dropout): x (B, N, d) -> (B, N, d), with an explicit softmax."""
    B, N, d = x.shape
    hd = d // num_heads
    qkv = F.linear(x, qkv_w, qkv_b).reshape(B, N, 3, num_heads, hd).permute(2, 0, 3, 1, 4)  # (3, B, H, N, hd)
    q, k, v = qkv[0], qkv[1], qkv[2]
    weights = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(hd), dim=-1)  # (B, H, N, N)
    out = (weights @ v).transpose(1, 2).reshape(B, N, d)
    return F.linear(out, proj_w, proj_b)


def default_states(pretrained_units: int, grown_sizes, task: int) -> torch.Tensor:
    """Default ternary states of task ``task``: 1 for the pretrained units and the units of tasks j < task, 2 for the
    task's own n_task units. Length pretrained_units + sum_{j <= task} n_j (units of later tasks do not exist for it;
    ``grown_sizes`` may list them, they are ignored)."""
    sizes = [int(n) for n in grown_sizes]
    assert 0 <= task < len(sizes), (task, len(sizes))
    old = pretrained_units + sum(sizes[:task])
    return torch.cat([torch.ones(old, dtype=torch.long), torch.full((sizes[task],), 2, dtype=torch.long)])


def pack_states(states: torch.Tensor) -> torch.Tensor:
    """2 bits per unit, 4 units per byte, the first unit in the two most significant bits; the last byte is padded
    with zeros (state 0). Returns uint8 of length ceil(n / 4)."""
    s = torch.as_tensor(states).long().flatten()
    assert bool(((s >= 0) & (s <= 2)).all()), "ternary states must be in {0, 1, 2}"
    n = s.numel()
    s = torch.cat([s, s.new_zeros((-n) % 4)]).reshape(-1, 4)
    packed = (s[:, 0] << 6) | (s[:, 1] << 4) | (s[:, 2] << 2) | s[:, 3]
    return packed.to(torch.uint8)


def unpack_states(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_states`: the first ``n`` 2-bit codes, as a LongTensor with values in {0, 1, 2}."""
    b = torch.as_tensor(packed).to(torch.long).flatten()
    assert 4 * b.numel() >= n, (b.numel(), n)
    codes = torch.stack([(b >> 6) & 3, (b >> 4) & 3, (b >> 2) & 3, b & 3], dim=1).flatten()[:n]
    assert bool((codes <= 2).all()), "code 3 is not a ternary state"
    return codes


def grown_mlp(h: torch.Tensor, p: dict, task: int, states: torch.Tensor) -> torch.Tensor:
    """Task ``task``'s MLP on the normed input h (B, N, d).

    With m = (states != 0), split into the pretrained group and the groups of tasks 0..task:
    ``F.linear(GELU(fc1(h)) * m_pre, fc2_w, fc2_b) + sum_{j <= task} (GELU(h W1_j^T + b1_j) * m_j) W2_j^T``,
    the groups added in task order (so a zero ``W2_task`` adds an exact zero to task task-1's output).
    """
    pre = p["fc1_w"].shape[0]
    sizes = [g[0].shape[0] for g in p["grown"][: task + 1]]
    assert states.numel() == pre + sum(sizes), (states.numel(), pre, sizes)
    mask = (states != 0).to(h.dtype)
    out = F.linear(F.gelu(F.linear(h, p["fc1_w"], p["fc1_b"])) * mask[:pre], p["fc2_w"], p["fc2_b"])
    start = pre
    for (W1, b1, W2), n in zip(p["grown"][: task + 1], sizes, strict=True):
        a = F.gelu(F.linear(h, W1, b1)) * mask[start : start + n]
        out = out + F.linear(a, W2)
        start += n
    return out


def block_forward(x: torch.Tensor, p: dict, task: int, num_heads: int) -> torch.Tensor:
    """One pre-norm timm ViT block for task ``task`` under TFM option G.

    x: (B, N, d). p: dict with "norm1_w", "norm1_b", "norm2_w", "norm2_b" (lists indexed by task: the task-specific
    LayerNorm affines), "qkv_w", "qkv_b", "proj_w", "proj_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b" (pretrained, frozen),
    "grown" (list over tasks of (W1_j (n_j, d), b1_j (n_j,), W2_j (d, n_j))) and optionally "states" (task ``task``'s
    ternary state vector over pretrained + sum_{j <= task} n_j units; default :func:`default_states`).
    Returns ``x' = x + attn(LN_s1(x)); x' + mlp_s(LN_s2(x'))``. Nothing of tasks > ``task`` is read.
    """
    states = p.get("states")
    if states is None:
        sizes = [g[0].shape[0] for g in p["grown"]]
        states = default_states(p["fc1_w"].shape[0], sizes, task)
    states = torch.as_tensor(states, device=x.device).long()
    h = layer_norm(x, p["norm1_w"][task], p["norm1_b"][task])
    x = x + attention(h, p["qkv_w"], p["qkv_b"], p["proj_w"], p["proj_b"], num_heads=num_heads)
    h = layer_norm(x, p["norm2_w"][task], p["norm2_b"][task])
    return x + grown_mlp(h, p, task, states)


def trainable_count(d: int, n_task: int, num_blocks: int, num_classes: int, per_task_norms: int | None = None) -> int:
    """Parameters trained by one task: per block n*d (fc1 rows) + n (fc1 bias) + d*n (fc2 columns); 2*d per task
    LayerNorm (``per_task_norms`` LayerNorms, default 2*num_blocks + 1: norm1, norm2 of every block and the final
    norm); the task head d*num_classes + num_classes. fc2's bias and all pretrained / earlier tensors are frozen."""
    if per_task_norms is None:
        per_task_norms = 2 * num_blocks + 1
    units = num_blocks * (n_task * d + n_task + d * n_task)
    return units + per_task_norms * 2 * d + d * num_classes + num_classes


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    dt = torch.float64
    B, N, d, H, pre, sizes = 2, 5, 8, 2, 32, [3, 4, 5]
    T = len(sizes)

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g, dtype=dt) * scale

    def make_params():
        return {
            "norm1_w": [1 + r(d) for _ in range(T)],
            "norm1_b": [r(d) for _ in range(T)],
            "norm2_w": [1 + r(d) for _ in range(T)],
            "norm2_b": [r(d) for _ in range(T)],
            "qkv_w": r(3 * d, d),
            "qkv_b": r(3 * d),
            "proj_w": r(d, d),
            "proj_b": r(d),
            "fc1_w": r(pre, d),
            "fc1_b": r(pre),
            "fc2_w": r(d, pre),
            "fc2_b": r(d),
            "grown": [(r(n, d), r(n), r(d, n)) for n in sizes],
        }

    p = make_params()
    x = r(B, N, d, scale=1.0)

    # The block with no growth and task 0's norms equals an independent composition (SDPA attention, plain MLP).
    p0 = dict(p, grown=[(r(0, d), r(0), r(d, 0))])
    h = F.layer_norm(x, (d,), p["norm1_w"][0], p["norm1_b"][0], 1e-6)
    q, k, v = F.linear(h, p["qkv_w"], p["qkv_b"]).reshape(B, N, 3, H, d // H).permute(2, 0, 3, 1, 4)
    y = x + F.linear(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, d), p["proj_w"], p["proj_b"])
    h = F.layer_norm(y, (d,), p["norm2_w"][0], p["norm2_b"][0], 1e-6)
    ref = y + F.linear(F.gelu(F.linear(h, p["fc1_w"], p["fc1_b"])), p["fc2_w"], p["fc2_b"])
    assert torch.allclose(block_forward(x, p0, 0, H), ref, atol=1e-12), "block != plain ViT block"

    # Default states and the 2-bit packing.
    st = default_states(pre, sizes, 1)
    assert st.tolist() == [1] * (pre + 3) + [2] * 4, st
    assert pack_states(torch.tensor([2, 1, 0, 2, 1])).tolist() == [0b10010010, 0b01000000]
    for n in (0, 1, 3, 4, 5, 37):
        s = torch.randint(0, 3, (n,), generator=g)
        packed = pack_states(s)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 3) // 4
        assert torch.equal(unpack_states(packed, n), s), n

    # Bit-exact: tensors of task s+1 (and later) never change task s's output.
    for s in range(T - 1):
        before = block_forward(x, p, s, H)
        q2 = dict(p, grown=list(p["grown"]), norm1_w=list(p["norm1_w"]), norm2_b=list(p["norm2_b"]))
        for j in range(s + 1, T):
            q2["grown"][j] = tuple(t + r(*t.shape, scale=5.0) for t in p["grown"][j])
            q2["norm1_w"][j] = r(d)
            q2["norm2_b"][j] = r(d)
        assert torch.equal(block_forward(x, q2, s, H), before), s

    # Zero W2_s + task s's LayerNorms copied from task s-1: task s output == task s-1 output (bit-exact here).
    for s in range(1, T):
        q3 = {key: (list(val) if isinstance(val, list) else val) for key, val in p.items()}
        W1, b1, W2 = p["grown"][s]
        q3["grown"][s] = (W1, b1, torch.zeros_like(W2))
        for key in ("norm1_w", "norm1_b", "norm2_w", "norm2_b"):
            q3[key][s] = p[key][s - 1].clone()
        assert torch.equal(block_forward(x, q3, s, H), block_forward(x, q3, s - 1, H)), s

    # State 0 on some units == those units' fc2 columns zeroed.
    s = 2
    st = default_states(pre, sizes, s)
    off = torch.zeros_like(st, dtype=torch.bool)
    off[[0, 5, pre + 1, pre + 3 + 2, pre + 7 + 4]] = True
    q4 = dict(p, states=st.masked_fill(off, 0))
    W2cat = torch.cat([p["fc2_w"]] + [gr[2] for gr in p["grown"]], dim=1).masked_fill(off[None], 0.0)
    q5 = dict(p, fc2_w=W2cat[:, :pre], grown=[])
    start = pre
    for W1, b1, W2 in p["grown"]:
        q5["grown"].append((W1, b1, W2cat[:, start : start + W2.shape[1]]))
        start += W2.shape[1]
    assert torch.allclose(block_forward(x, q4, s, H), block_forward(x, q5, s, H), atol=1e-12)

    # Trainable parameter count (ViT-B, n = 307, 10 classes).
    assert trainable_count(768, 307, 12, 10) == 12 * (2 * 307 * 768 + 307) + 25 * 2 * 768 + 7690
    assert trainable_count(4, 2, 1, 3, 3) == (8 + 2 + 8) + 24 + 15
    print("tfm_reference self-check OK")
