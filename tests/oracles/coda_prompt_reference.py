"""Independent plain-PyTorch transcription ("oracle") of CODA-Prompt's official prompt module and prompted forward.

Source: github:GT-RIPL/CODA-Prompt at HEAD commit 6417d4f68754be68b697c7ca2323ee61e791e1a3
("domainnet, FT, and forgetting"). Line numbers below are those of ``git show HEAD:<path> | cat -n``:

* ``models/zoo.py``  -- ``CodaPrompt.gram_schmidt`` (75-131), ``CodaPrompt.forward`` (133-195),
  ``ortho_penalty`` (197-198), ``ViTZoo.forward`` (390-407).
* ``models/vit.py``  -- ``Attention.forward`` (63-86), ``Block.forward`` (104-107),
  ``VisionTransformer.forward`` (176-210).
* ``learners/prompt.py`` -- ``Prompt.update_model`` logit handling (25-37).
* ``learners/default.py`` -- test-time logit slicing ``[:, :self.valid_out_dim]`` (179, 192, 279).

This file was written without reading the project's own implementation. It uses the official code's own
operation order (e.g. classical Gram-Schmidt, ``(q @ k^T) * scale`` then an explicit softmax) so that it
can serve as a numerical reference. The official ``.cuda()`` calls (zoo.py:198, vit.py:186) are replaced by
the device of the tensors involved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["forward", "gram_schmidt", "layer_prompt", "ortho_penalty", "prefix_attention"]


def gram_schmidt(vv, start, end, fresh):
    """The official CodaPrompt.gram_schmidt for a parameter vv of shape (M, D) or (M, L, D) (3-D flattened to (M, L*D)
    as the code does), with the task slice [start, end): old rows [0, start) kept verbatim, rows [start, end) made from
    fresh random vectors orthogonalised against all earlier columns by the code's classical projection loop (the
    randn_like draw for column k replaced by fresh[k - start], fresh of shape (end - start, flattened dim)), then
    normalised; rows [end, M) zero. Returns a tensor of vv's shape. (The official redo loop for a degenerate column need
    not be reproduced beyond raising on it.)

    Transcribes models/zoo.py:75-131 (``projection`` 77-83, 3-D flattening 86-89, transpose 92, ``uu = zeros_like``
    96, old columns copied 102-103, projection loop 104-119, normalisation of the new columns only 120-122, undo
    transpose / reshape 125-129). ``start``/``end`` stand for ``s = task_count * pt`` and ``f = (task_count + 1) * pt``
    (zoo.py:99-101). The result is a plain (detached) tensor rather than the official ``nn.Parameter`` (zoo.py:131).
    """
    with torch.no_grad():
        shape = vv.shape
        is_3d = vv.dim() == 3  # zoo.py:86
        v2 = vv.detach().reshape(shape[0], -1) if is_3d else vv.detach()  # zoo.py:87-89
        if v2.dim() != 2:
            raise ValueError(f"gram_schmidt expects a 2-D or 3-D tensor, got shape {tuple(shape)}")
        m, dim = v2.shape
        if not (0 <= start <= end <= m):
            raise ValueError(f"bad slice [{start}, {end}) for {m} rows")
        fresh = torch.as_tensor(fresh).to(device=v2.device, dtype=v2.dtype)
        if fresh.shape != (end - start, dim):
            raise ValueError(f"fresh must have shape {(end - start, dim)}, got {tuple(fresh.shape)}")

        vt = v2.T  # zoo.py:92 (columns = components)
        uu = torch.zeros_like(vt)  # zoo.py:96
        if start > 0:  # zoo.py:102-103
            uu[:, 0:start] = vt[:, 0:start].clone()
        for k in range(start, end):  # zoo.py:104
            vk = fresh[k - start]  # zoo.py:108 (randn_like replaced by fresh)
            uk = 0
            for j in range(0, k):  # zoo.py:110-118
                uj = uu[:, j].clone()
                denominator = (uj * uj).sum()  # zoo.py:78
                if denominator < 1e-8:  # zoo.py:80-81 (official: print + redo)
                    raise RuntimeError(
                        f"gram_schmidt: column {j} is degenerate (squared norm {float(denominator):.3e} < 1e-8); "
                        "the official code would loop ('restarting!!!')"
                    )
                proj = (vk * uj).sum() / denominator * uj  # zoo.py:83
                uk = uk + proj
            uu[:, k] = vk - uk  # zoo.py:119
        for k in range(start, end):  # zoo.py:120-122
            uk = uu[:, k].clone()
            uu[:, k] = uk / (uk.norm())
        uu = uu.T  # zoo.py:125
        return uu.reshape(shape).contiguous()  # zoo.py:128-129


def ortho_penalty(t):
    """Official ortho_penalty: ((t @ t.T - I) ** 2).mean() for t of shape (n, d) (on t's device).

    Transcribes models/zoo.py:197-198 (``torch.eye(t.shape[0]).cuda()`` replaced by an identity on t's device/dtype).
    """
    eye = torch.eye(t.shape[0], device=t.device, dtype=t.dtype)
    return ((t @ t.T - eye) ** 2).mean()


def layer_prompt(q, K, A, P, *, task_count, n_tasks, train, ortho_mu=0.0):
    """Official CodaPrompt.forward for one prompted layer: q (B, D) the query; K, A (M, D); P (M, Lp, D) (the full pool);
    components per task pt = M // n_tasks; s = task_count * pt; f = (task_count + 1) * pt; at training the rows [0, s) of
    K, A, P are detached (task_count > 0) or only [s, f) used (task_count == 0); at test rows [0, f). alpha = cos(q ⊙ A_m,
    K_m) (F.normalize on both, as the code), prompt = einsum over components, split into Ek = first Lp//2 rows and Ev = the
    rest. The ortho loss (train and ortho_mu > 0): ortho_mu * (penalty(K) + penalty(A) + penalty(P.flatten(1))) on the
    rows used. Returns (Ek (B, Lp//2, D), Ev (B, Lp - Lp//2, D), loss (a 0-d tensor, 0 when not computed)).

    Transcribes models/zoo.py:133-195: slice bounds 144-146 (``e_pool_size`` = M = K.shape[0]), freeze/control of past
    tasks 148-161, cosine weights and prompt assembly 163-171, key/value split 173-176 (``i = int(Lp / 2)``), ortho
    penalty 178-184 (the official returns the int ``0`` when not computed; here a 0-d zero tensor).
    """
    m = K.shape[0]  # e_pool_size
    lp = P.shape[1]  # e_p_length
    pt = int(m / n_tasks)  # zoo.py:144
    s = int(task_count * pt)  # zoo.py:145
    f = int((task_count + 1) * pt)  # zoo.py:146

    if train:  # zoo.py:149-157
        if task_count > 0:
            K = torch.cat((K[:s].detach().clone(), K[s:f]), dim=0)
            A = torch.cat((A[:s].detach().clone(), A[s:f]), dim=0)
            p = torch.cat((P[:s].detach().clone(), P[s:f]), dim=0)
        else:
            K = K[s:f]
            A = A[s:f]
            p = P[s:f]
    else:  # zoo.py:158-161
        K = K[0:f]
        A = A[0:f]
        p = P[0:f]

    a_querry = torch.einsum("bd,kd->bkd", q, A)  # zoo.py:165
    n_K = F.normalize(K, dim=1)  # zoo.py:167
    qn = F.normalize(a_querry, dim=2)  # zoo.py:168
    aq_k = torch.einsum("bkd,kd->bk", qn, n_K)  # zoo.py:169
    P_ = torch.einsum("bk,kld->bld", aq_k, p)  # zoo.py:171

    i = int(lp / 2)  # zoo.py:174
    Ek = P_[:, :i, :]  # zoo.py:175
    Ev = P_[:, i:, :]  # zoo.py:176

    if train and ortho_mu > 0:  # zoo.py:179-182
        loss = ortho_penalty(K) * ortho_mu
        loss = loss + ortho_penalty(A) * ortho_mu
        loss = loss + ortho_penalty(p.reshape(p.shape[0], -1)) * ortho_mu
    else:  # zoo.py:183-184
        loss = torch.zeros((), device=q.device, dtype=q.dtype)
    return Ek, Ev, loss


def prefix_attention(attn, x, Ek, Ev):
    """Official vit.py Attention.forward with prompt=(Ek, Ev) for a timm.models.vision_transformer.Attention `attn`
    (use attn.qkv, attn.proj, attn.num_heads; scale head_dim ** -0.5; an explicit softmax, not SDPA): Ek, Ev (B, L, D)
    reshaped to (B, heads, L, head_dim) and prepended to k and v. Ek=Ev=None: plain attention. Returns (B, N, D).

    Transcribes models/vit.py:63-86 (qkv reshape 64-66, prompt reshape and prepend 68-73, ``(q @ k^T) * scale`` and
    softmax 75-76, output 83-84). Attention dropout / proj dropout / hook (77-81, 85) are no-ops at rate 0 and are
    omitted. timm's optional q_norm / k_norm / scale-norm / gate (absent from the official BLIP-derived Attention) must
    be identities here.
    """
    for name in ("q_norm", "k_norm", "norm"):
        mod = getattr(attn, name, None)
        if mod is not None and not isinstance(mod, nn.Identity):
            raise ValueError(f"official Attention has no {name}; got {type(mod).__name__}")
    if getattr(attn, "gate", None) is not None:
        raise ValueError("official Attention has no gate")

    B, N, C = x.shape
    H = attn.num_heads
    hd = C // H
    scale = hd**-0.5  # vit.py:41-43
    qkv = attn.qkv(x).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)  # vit.py:65
    q, k, v = qkv[0], qkv[1], qkv[2]  # vit.py:66

    if Ek is not None or Ev is not None:  # vit.py:68-73
        if Ek is None or Ev is None:
            raise ValueError("Ek and Ev must both be given or both be None")
        pk = Ek.reshape(B, -1, H, hd).permute(0, 2, 1, 3)
        pv = Ev.reshape(B, -1, H, hd).permute(0, 2, 1, 3)
        k = torch.cat((pk, k), dim=2)
        v = torch.cat((pv, v), dim=2)

    a = (q @ k.transpose(-2, -1)) * scale  # vit.py:75
    a = a.softmax(dim=-1)  # vit.py:76
    out = (a @ v).transpose(1, 2).reshape(B, N, C)  # vit.py:83
    return attn.proj(out)  # vit.py:84


def _encode(vit, x, prompts):
    """vit.py:176-210 with the timm module layout: embed, blocks (prefix given per block index), final norm."""
    x = vit.patch_embed(x)  # vit.py:178
    x = vit._pos_embed(x)  # vit.py:180-184 (cls token, pos embed, pos drop)
    x = vit.norm_pre(x)  # identity for the official (pre-norm-free) ViT
    for i, blk in enumerate(vit.blocks):  # vit.py:187-205
        Ek, Ev = prompts.get(i, (None, None))
        # Block.forward, vit.py:104-107 (timm's ls1/ls2 are identities for the official model)
        x = x + blk.ls1(prefix_attention(blk.attn, blk.norm1(x), Ek, Ev))
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    return vit.norm(x)  # vit.py:208


def forward(
    vit,
    x,
    *,
    layers,
    params,
    head_weight,
    head_bias,
    task_count,
    n_tasks,
    train,
    ortho_mu=0.0,
    seen_classes,
    task_classes,
):
    """The whole CODA-Prompt forward (official ViTZoo.forward + vit.py's encoder loop + learners/prompt.py's logit
    handling) on a timm VisionTransformer `vit` with a class token (global_pool='token'; use vit.patch_embed,
    vit._pos_embed, vit.norm_pre, vit.blocks (x = x + ls1(attn(norm1(x))), x = x + ls2(mlp(norm2(x)))), vit.norm):
    - q = final-norm CLS token of an unprompted pass under no_grad;
    - params: {layer: (P, K, A)} for each prompted block in `layers`; each block's attention gets that layer's prefix from
      layer_prompt(q, K, A, P, ...);
    - logits = final-norm CLS of the prompted pass @ head_weight.T + head_bias (head_weight (C, D), C = all classes);
    - at training (official learners/prompt.py): logits[:, :seen_classes] kept, i.e. sliced to the seen classes, then the
      classes before task_classes[0] set to -inf (past tasks); at test: logits sliced to the seen classes.
    Returns (logits, prompt_loss summed over layers).

    Transcribes models/zoo.py:390-407 (query pass under no_grad 393-395, prompted pass 396-397, ``self.last`` 403),
    models/vit.py:176-210 (per-block ``prompt.forward`` then ``blk(x, prompt=p_list)``, ``prompt_loss += loss``; the
    official zero-initialised ``(1,)`` accumulator is returned here as a 0-d sum, as learners/prompt.py:37 sums it),
    learners/prompt.py:28-32 (``logits[:, :valid_out_dim]`` then ``logits[:, :last_valid_out_dim] = -inf``) and
    learners/default.py:179/192/279 (test: ``[:, :valid_out_dim]``). ``seen_classes`` = valid_out_dim and
    ``task_classes[0]`` = last_valid_out_dim: this assumes, as the official data pipeline does, that class ids are
    remapped so each task's classes are the contiguous block [last_valid_out_dim, valid_out_dim).
    """
    if getattr(vit, "cls_token", None) is None:
        raise ValueError("vit must have a class token")
    layers = list(layers)

    with torch.no_grad():  # zoo.py:393-395
        q = _encode(vit, x, {})[:, 0, :]

    prompts = {}
    prompt_loss = torch.zeros((), device=x.device, dtype=q.dtype)  # vit.py:186
    for i in range(len(vit.blocks)):  # vit.py:187-194 (prompt.forward for each block)
        if i in layers:
            P, K, A = params[i]
            Ek, Ev, loss = layer_prompt(
                q, K, A, P, task_count=task_count, n_tasks=n_tasks, train=train, ortho_mu=ortho_mu
            )
            prompts[i] = (Ek, Ev)
            if train:  # vit.py:190-192 (test: loss discarded, 193-194)
                prompt_loss = prompt_loss + loss
    out = _encode(vit, x, prompts)[:, 0, :]  # zoo.py:396-397
    out = out.reshape(out.size(0), -1)  # zoo.py:401
    logits = F.linear(out, head_weight, head_bias)  # zoo.py:403 (self.last)

    logits = logits[:, :seen_classes]  # prompt.py:29 / default.py:279
    if train:
        past = int(task_classes[0])  # last_valid_out_dim
        logits = logits.clone()
        logits[:, :past] = -float("inf")  # prompt.py:32
    return logits, prompt_loss


# ----------------------------------------------------------------------------------------------------------------------
if __name__ == "__main__":
    import time

    import timm

    t0 = time.time()
    torch.manual_seed(0)

    # --- gram_schmidt: new rows orthonormal and orthogonal to orthonormal old rows; old kept; future zero -------------
    M, n_tasks, D = 6, 3, 16
    pt = M // n_tasks
    old = torch.linalg.qr(torch.randn(D, pt, dtype=torch.float64))[0].T  # (pt, D) orthonormal rows
    vv = torch.rand(M, D, dtype=torch.float64)
    vv[:pt] = old
    g = gram_schmidt(vv, pt, 2 * pt, torch.randn(pt, D, dtype=torch.float64))
    used = g[: 2 * pt]
    assert g.shape == vv.shape
    assert torch.equal(g[:pt], old)
    assert torch.allclose(used @ used.T, torch.eye(2 * pt, dtype=torch.float64), atol=1e-12)
    assert torch.count_nonzero(g[2 * pt :]) == 0
    # 3-D case at task 0: rows [0, pt) orthonormal in the flattened space, rest zero.
    g3 = gram_schmidt(torch.rand(M, 4, 8), 0, pt, torch.randn(pt, 32))
    f3 = g3.reshape(M, -1)
    assert g3.shape == (M, 4, 8)
    assert torch.allclose(f3[:pt] @ f3[:pt].T, torch.eye(pt), atol=1e-5)
    assert torch.count_nonzero(f3[pt:]) == 0
    try:
        gram_schmidt(torch.zeros(M, D), pt, 2 * pt, torch.randn(pt, D))
    except RuntimeError:
        pass
    else:
        raise AssertionError("degenerate old column must raise")

    # --- small random timm ViT ----------------------------------------------------------------------------------------
    vit = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=4,
        num_heads=2,
        num_classes=0,
    ).eval()
    for prm in vit.parameters():
        prm.requires_grad_(False)
    x = torch.randn(3, 3, 32, 32)

    # prefix_attention without prompts reproduces timm's own attention; forward features reproduce timm's.
    h = vit.blocks[0].norm1(vit._pos_embed(vit.patch_embed(x)))
    assert torch.allclose(prefix_attention(vit.blocks[0].attn, h, None, None), vit.blocks[0].attn(h), atol=1e-5)
    assert torch.allclose(_encode(vit, x, {}), vit.forward_features(x), atol=1e-5)

    Dm, Lp, layers = 32, 4, [0, 1, 2]
    task_count, n_cls_task = 1, 3
    params = {}
    for layer in layers:
        P = torch.rand(M, Lp, Dm)
        K = torch.rand(M, Dm)
        A = torch.rand(M, Dm)
        # task 0 init then task 1 init, as the official construction + process_task_count do
        for t in range(task_count + 1):
            P = gram_schmidt(P, t * pt, (t + 1) * pt, torch.randn(pt, Lp * Dm))
            K = gram_schmidt(K, t * pt, (t + 1) * pt, torch.randn(pt, Dm))
            A = gram_schmidt(A, t * pt, (t + 1) * pt, torch.randn(pt, Dm))
        params[layer] = tuple(tn.clone().requires_grad_(True) for tn in (P, K, A))
    C = n_tasks * n_cls_task
    head_w = (0.02 * torch.randn(C, Dm)).requires_grad_(True)
    head_b = torch.zeros(C, requires_grad=True)
    seen = (task_count + 1) * n_cls_task
    task_classes = list(range(task_count * n_cls_task, seen))
    y = torch.tensor(task_classes)

    logits, ploss = forward(
        vit,
        x,
        layers=layers,
        params=params,
        head_weight=head_w,
        head_bias=head_b,
        task_count=task_count,
        n_tasks=n_tasks,
        train=True,
        ortho_mu=0.1,
        seen_classes=seen,
        task_classes=task_classes,
    )
    assert logits.shape == (3, seen)
    assert torch.isinf(logits[:, : task_classes[0]]).all() and torch.isfinite(logits[:, task_classes[0] :]).all()
    assert ploss.dim() == 0 and torch.isfinite(ploss) and ploss > 0
    loss = F.cross_entropy(logits, y) + ploss
    assert torch.isfinite(loss)
    loss.backward()
    s, f = task_count * pt, (task_count + 1) * pt
    for layer in layers:
        for tn in params[layer]:
            gr = tn.grad
            assert gr is not None and torch.isfinite(gr).all()
            assert torch.count_nonzero(gr[:s]) == 0 and torch.count_nonzero(gr[f:]) == 0
            assert torch.count_nonzero(gr[s:f]) > 0
    assert torch.isfinite(head_w.grad).all()
    assert torch.count_nonzero(head_w.grad[: task_classes[0]]) == 0
    assert torch.count_nonzero(head_w.grad[seen:]) == 0
    assert torch.count_nonzero(head_w.grad[task_classes[0] : seen]) > 0

    # test mode: all rows [0, f) used, logits sliced to the seen classes, no prompt loss
    with torch.no_grad():
        tl, tp = forward(
            vit,
            x,
            layers=layers,
            params=params,
            head_weight=head_w,
            head_bias=head_b,
            task_count=task_count,
            n_tasks=n_tasks,
            train=False,
            ortho_mu=0.1,
            seen_classes=seen,
            task_classes=task_classes,
        )
    assert tl.shape == (3, seen) and torch.isfinite(tl).all() and float(tp) == 0.0

    print(f"coda_prompt_reference self-check OK ({time.time() - t0:.2f}s)")
