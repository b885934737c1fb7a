"""An independent, plain-PyTorch transcription ("oracle") of DualPrompt's official prompt module and prompted forward.

Written from the official sources only, for use as a test reference:

* JAX (official): google-research/l2p @ dd8836e6e372df29f03d83bf3dc3a806114e9d8e
  - models/prefix_attention.py  (MultiHeadDotProductAttention with ``prefix``)
  - models/prompt.py            (``l2_normalize``, ``Prompt`` key-query matching and prompt gather)
  - models/vit.py               (``Encoder1DBlock``, ``Encoder`` G/E prefix placement, ``VisionTransformer`` head)
  - train_continual.py          (``use_prompt_mask``, ``train_mask`` and the loss in ``train_step``)
* PyTorch port (endorsed by the official README): JH-LEE-KR/dualprompt-pytorch @ 7eb457d988409a6abf97af2b121ffa62dd4b498a
  - prompt.py (``EPrompt``), attention.py (``PreT_Attention``), vision_transformer.py, engine.py

Where the two codes differ this module follows the JAX code:

* E-prompt gather (PT prompt.py:117-122 reshapes ``(layers, 2, B, k, L, H, d)`` straight to ``(layers, B, 2, ...)``,
  mixing the key/value halves and batch entries; JAX models/prompt.py:226-232 keeps the ``(layers, 2, B, ...)`` order,
  so every sample gets its own selected slot's key prefix and value prefix). We follow JAX.
* A block in both the G and the E layer list (PT vision_transformer.py:546-566 uses if/elif, so G wins and E is
  dropped; JAX models/vit.py:229-235 concatenates ``[g, e]`` along the length). We follow JAX.

Layout used here: a prefix vector is a flat D = num_heads * head_dim vector whose channel c belongs to head
c // head_dim (equivalent to the official (..., H, head_dim) storage, JAX DenseGeneral features=(H, head_dim),
PT/timm ``qkv.reshape(B, N, 3, H, head_dim)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _l2_normalize(x: torch.Tensor, dim: int = -1, epsilon: float = 1e-12) -> torch.Tensor:
    """JAX models/prompt.py:31-35 (= PT prompt.py:67-71): x * rsqrt(max(sum(x^2), eps)), eps = 1e-12."""
    square_sum = torch.sum(x * x, dim=dim, keepdim=True)
    return x * torch.rsqrt(torch.clamp(square_sum, min=epsilon))


def prefix_attention(attn, x, prefix):
    """Prefix-tuning multi-head self-attention on a timm ``Attention`` module.

    Transcribes JAX models/prefix_attention.py:111-136 + 180-199 (q/k/v projection; ``key = concat([prefix[0], key])``,
    ``value = concat([prefix[1], value])`` on the sequence axis; flax ``dot_product_attention`` = softmax(q k^T /
    sqrt(head_dim)) v with no mask; output dense) and PT attention.py:26-52 (``PreT_Attention``: the same with timm's
    fused ``qkv`` and ``proj``).

    attn: a timm.models.vision_transformer.Attention (uses attn.qkv, attn.proj, attn.num_heads; q_norm/k_norm/norm are
    required to be Identity and dropout is ignored). x: (B, N, D). prefix: None or (B, 2, L, D): prefix[:, 0] the key
    prefix, prefix[:, 1] the value prefix, channel c of D belonging to head c // head_dim. The prefixes are prepended,
    unprojected and without bias, to the already projected keys/values; queries are the N real tokens only, so the
    output keeps length N. Returns (B, N, D) after attn.proj, computed with an explicit softmax.
    """
    for name in ("q_norm", "k_norm", "norm"):
        mod = getattr(attn, name, None)
        assert mod is None or isinstance(mod, nn.Identity), f"attn.{name} must be Identity for this oracle"
    assert getattr(attn, "gate", None) is None, "gated attention is not supported"
    B, N, D = x.shape
    H = attn.num_heads
    hd = D // H
    qkv = attn.qkv(x).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)  # (3, B, H, N, hd)
    q, k, v = qkv[0], qkv[1], qkv[2]
    if prefix is not None:
        assert prefix.dim() == 4 and prefix.shape[0] == B and prefix.shape[1] == 2 and prefix.shape[3] == D, (
            prefix.shape
        )
        L = prefix.shape[2]
        p = prefix.reshape(B, 2, L, H, hd).permute(1, 0, 3, 2, 4)  # (2, B, H, L, hd)
        k = torch.cat([p[0].to(k.dtype), k], dim=2)  # (B, H, L + N, hd)
        v = torch.cat([p[1].to(v.dtype), v], dim=2)
    scale = hd**-0.5
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, L + N)
    weights = torch.softmax(logits, dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(B, N, D)
    return attn.proj(out)


def select(query, keys, *, top_k=1, batchwise=False, forced=None):
    """Key-query matching of the E-prompt pool.

    Transcribes JAX models/prompt.py:204-223 + 246-250 (PT prompt.py:90-114 + 130-141) and the prompt mask of
    JAX train_continual.py:237-245 (PT vision_transformer.py:530-538):

    * cosine similarity ``sim = l2n(query) @ l2n(keys).T`` (l2n: x * rsqrt(max(sum x^2, 1e-12))), ``idx = top_k(sim)``
      (descending, so column 0 is the best match);
    * batchwise: majority vote over the flattened (B * top_k) indices: ids sorted ascending with their counts (padded to
      P with the smallest id and count 0, as ``jnp.unique(..., size=P)``), the top_k most frequent ids (ties to the
      smaller id, as the stable ``jax.lax.top_k``), broadcast to every sample;
    * forced (int task id; use_prompt_mask at training): idx = slots [forced*top_k, (forced+1)*top_k) for every sample,
      unless (forced+1)*top_k > P, in which case both official codes set prompt_mask = None and keep the matching;
    * reduce_sim = sum over b, k of l2n(keys)[idx[b, k]] . l2n(query[b]), divided by B (gradient reaches the keys).

    query (B, D), keys (P, D). Returns (idx (B, top_k) long, reduce_sim scalar).
    """
    B = query.shape[0]
    P = keys.shape[0]
    key_norm = _l2_normalize(keys, dim=-1)  # (P, D)
    q_norm = _l2_normalize(query, dim=-1)  # (B, D)
    sim = q_norm @ key_norm.t()  # (B, P)
    idx = torch.topk(sim, k=top_k, dim=1).indices  # (B, top_k)
    if batchwise:
        ids, counts = torch.unique(idx.flatten(), sorted=True, return_counts=True)
        if ids.shape[0] < P:
            pad = P - ids.shape[0]
            ids = torch.cat([ids, ids.new_full((pad,), int(idx.min()))])
            counts = torch.cat([counts, counts.new_zeros(pad)])
        order = torch.sort(counts, descending=True, stable=True).indices[:top_k]
        idx = ids[order].unsqueeze(0).expand(B, top_k).contiguous()
    if forced is not None:
        start, end = forced * top_k, (forced + 1) * top_k
        if end <= P:
            idx = torch.arange(start, end, device=query.device).unsqueeze(0).expand(B, top_k).contiguous()
    idx = idx.long()
    selected_key = key_norm[idx]  # (B, top_k, D)
    reduce_sim = torch.sum(selected_key * q_norm.unsqueeze(1)) / B
    return idx, reduce_sim


def _run_blocks(vit, x, prefixes):
    """Embedding, blocks and final norm. JAX models/vit.py:127-159 (Encoder1DBlock: x + Attn(LN(x), prefix), then
    x + MLP(LN(x))) and :254 (encoder_norm); PT vision_transformer.py:251-254, 518-574. ``prefixes``: block index ->
    (B, 2, L, D) or absent. Returns the final-normed tokens (B, N, D)."""
    x = vit.patch_embed(x)
    x = vit._pos_embed(x)
    x = vit.norm_pre(x)
    for i, blk in enumerate(vit.blocks):
        x = x + blk.ls1(prefix_attention(blk.attn, blk.norm1(x), prefixes.get(i)))
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    return vit.norm(x)


def forward(
    vit,
    x,
    *,
    g_prompt,
    g_layers,
    e_prompt,
    e_layers,
    keys,
    head_weight,
    head_bias,
    train,
    task_id,
    class_mask=None,
    top_k=1,
    batchwise=False,
):
    """The whole DualPrompt forward (prefix-tuning mode for both G and E prompts).

    Transcribes JAX models/vit.py:298-479 (E-prompt module on the ``cls_features`` query, :400-406; Encoder prefix
    placement, :209-253, G and E concatenated ``[g, e]`` along the length when a block is in both lists, :229-235;
    CLS read after encoder_norm, :440-444; head, :472-478), JAX models/prompt.py:204-250 (selection and per-sample
    gather, :226-232), JAX train_continual.py:237-286 (prompt mask; query from the unprompted original ViT's
    ``pre_logits``, :249-256; ``train_mask`` sets every non-current-task logit to -inf, :271-283), and the PT port's
    vision_transformer.py:518-597 / engine.py:49-64 (query under no_grad, ``index_fill(-inf)``).

    vit: a timm VisionTransformer with a class token (global_pool='token', no_embed_class False, no reg tokens,
    pre-norm blocks, drop_path identity). x: (B, 3, H, W) already normalised.
    g_prompt: (len(g_layers), 2, Lg, D); e_prompt: (len(e_layers), 2, P, Le, D); keys (P, D); head_weight (C, D);
    head_bias (C,). Sample b's E prefix in block e_layers[i] is e_prompt[i, :, idx_b].reshape(2, top_k * Le, D).
    Returns dict(logits=(B, C), reduce_sim=scalar, idx=(B, top_k)).
    """
    B = x.shape[0]
    with torch.no_grad():  # the frozen, unprompted "original" ViT (JAX train_continual.py:249-256, PT engine.py:49-54)
        query = _run_blocks(vit, x, {})[:, 0]
    idx, reduce_sim = select(query, keys, top_k=top_k, batchwise=batchwise, forced=task_id if train else None)

    g_layers = list(g_layers) if g_prompt is not None else []
    e_layers = list(e_layers) if e_prompt is not None else []
    prefixes = {}
    for i, layer in enumerate(g_layers):
        g = g_prompt[i]  # (2, Lg, D), the same for every sample (JAX expand_to_batch, vit.py:218-221)
        prefixes[layer] = g.unsqueeze(0).expand(B, *g.shape)
    for i, layer in enumerate(e_layers):
        D = e_prompt.shape[-1]
        # e_prompt[i][:, idx]: (2, B, top_k, Le, D) -> per sample (B, 2, top_k * Le, D); JAX prompt.py:226-232
        e = e_prompt[i][:, idx].permute(1, 0, 2, 3, 4).reshape(B, 2, top_k * e_prompt.shape[3], D)
        prefixes[layer] = torch.cat([prefixes[layer], e], dim=2) if layer in prefixes else e

    feats = _run_blocks(vit, x, prefixes)[:, 0]
    logits = feats @ head_weight.t() + head_bias
    if train and class_mask is not None:
        keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[torch.as_tensor(list(class_mask), dtype=torch.long, device=logits.device)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    return dict(logits=logits, reduce_sim=reduce_sim, idx=idx)


def loss(out, y, pull_coeff=1.0):
    """Official training loss: mean cross-entropy(out['logits'], y) - pull_coeff * out['reduce_sim'].

    JAX train_continual.py:285-295 (``softmax_cross_entropy_loss`` mean, ``loss - pull_constraint_coeff *
    reduce_sim``); PT engine.py:66-68 (``CrossEntropyLoss`` then the same subtraction).
    """
    return F.cross_entropy(out["logits"], y) - pull_coeff * out["reduce_sim"]


if __name__ == "__main__":
    import timm

    torch.manual_seed(0)
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
    for p in vit.parameters():
        p.requires_grad_(False)
    D, B, C, P, Lg, Le, k = 32, 4, 6, 3, 2, 3, 1

    xs = torch.randn(B, 5, D)
    attn = vit.blocks[0].attn
    assert torch.allclose(prefix_attention(attn, xs, None), attn(xs), atol=1e-5), "prefix=None must equal attn(x)"

    g_prompt = torch.empty(2, 2, Lg, D).uniform_(-1, 1).requires_grad_()
    e_prompt = torch.empty(3, 2, P, Le, D).uniform_(-1, 1).requires_grad_()
    keys = torch.empty(P, D).uniform_(-1, 1).requires_grad_()
    head_w = (0.02 * torch.randn(C, D)).requires_grad_()
    head_b = torch.zeros(C, requires_grad=True)
    img = torch.randn(B, 3, 32, 32)
    y = torch.tensor([2, 3, 2, 3])
    # g layers {0, 1}, e layers {1, 2, 3}: block 1 is in both lists and gets [g, e].
    out = forward(
        vit,
        img,
        g_prompt=g_prompt,
        g_layers=[0, 1],
        e_prompt=e_prompt,
        e_layers=[1, 2, 3],
        keys=keys,
        head_weight=head_w,
        head_bias=head_b,
        train=True,
        task_id=1,
        class_mask=[2, 3],
        top_k=k,
    )
    assert out["logits"].shape == (B, C) and out["idx"].shape == (B, k) and out["reduce_sim"].dim() == 0
    assert (out["idx"] == 1).all()
    assert torch.isinf(out["logits"][:, [0, 1, 4, 5]]).all() and torch.isfinite(out["logits"][:, [2, 3]]).all()
    lo = loss(out, y)
    assert torch.isfinite(lo)
    lo.backward()
    for name, t in dict(g=g_prompt, e=e_prompt, keys=keys, w=head_w, b=head_b).items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
    assert e_prompt.grad[:, :, [0, 2]].abs().sum() == 0 and e_prompt.grad[:, :, 1].abs().sum() > 0
    assert keys.grad[[0, 2]].abs().sum() == 0 and keys.grad[1].abs().sum() > 0
    assert head_w.grad[[0, 1, 4, 5]].abs().sum() == 0

    with torch.no_grad():
        ev = forward(
            vit,
            img,
            g_prompt=g_prompt,
            g_layers=[0, 1],
            e_prompt=e_prompt,
            e_layers=[2, 3],
            keys=keys,
            head_weight=head_w,
            head_bias=head_b,
            train=False,
            task_id=1,
            top_k=2,
            batchwise=True,
        )
    assert ev["logits"].shape == (B, C) and torch.isfinite(ev["logits"]).all() and ev["idx"].shape == (B, 2)
    print("dualprompt_reference self-check OK")
