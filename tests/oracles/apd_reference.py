"""An independent, plain-PyTorch transcription ("oracle") of APD's per-layer rules (Additive Parameter Decomposition).

Written from the official code only, for use as a test reference:

* TensorFlow (official): jaehong31/APD @ 6b6b67d1147f3d758b13fd4a799d4038b3bc14be
  - cifar100_apd.py      (``gen_mask``, ``l1_pruning``, ``build_model``, ``build_model_test``, ``k_means_clustering``,
                          ``aw_consolidation``, ``optimization``, ``create_task_parameters``)
  - cifar100_apd_run.py  (task loop, consolidation schedule, "capacity" print)

Names in the code: σ = ``global/shared_weights/layer{l}``, M_t = ``task{t}/mask/layer{l}`` (logits, used as sigmoid),
τ_t = ``task{t}/aw_all/layer{l}``, τ̃_g = ``id{L}_local{g}/aw_group/layer{l}`` (local-shared, one per cluster g).

Layout used here: ONE layer at a time, weights in PyTorch layout (out, in[, kh, kw]); a mask is a vector over the
OUTPUT units, shape (out,). The code's TF layouts are FC [in, out] and conv [kh, kw, c_in, c_out] with the mask of
shape [out] / [c_out] broadcast over the last (output) axis (cifar100_apd.py:31,40 + 237,294), which is axis 0 here.
"""

from __future__ import annotations

import math

import torch


def _gate(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape an (out,) vector to (out, 1, ..., 1) so it broadcasts over the output axis (axis 0) of ``like``."""
    assert mask.dim() == 1 and mask.shape[0] == like.shape[0], (tuple(mask.shape), tuple(like.shape))
    return mask.reshape((-1,) + (1,) * (like.dim() - 1))


def theta(sigma, mask_logits, tau, shared=None):
    """Training-time task parameters θ = σ ⊗ sigmoid(M) + τ [+ τ̃].

    cifar100_apd.py ``build_model``: ``sw * g_mask + aw`` (lines 237, 294) with ``g_mask = gen_mask(mask)`` =
    tf.nn.sigmoid (140-141); for an earlier task j the drift term uses ``sw * g_pmask + full_paw`` with
    ``full_paw = local_shared + paw`` when j sits in a multi-member cluster (260-262, 273; 316-318, 330).
    Nothing is thresholded here (thresholds are test-time only, see ``test_theta``).
    """
    out = sigma * _gate(torch.sigmoid(mask_logits), sigma) + tau
    if shared is not None:
        out = out + shared
    return out


def hard_threshold(x, c):
    """x · 1[|x| > c] (strict), cifar100_apd.py ``l1_pruning`` (143-145): ``weights * cast(greater(abs(w), hyp))``."""
    return x * (x.abs() > c).to(x.dtype)


def test_theta(sigma, mask_logits, tau, shared, threshold, mask_threshold=0.0):  # noqa: PLR0917 (fixed API)
    """Test-time parameters θ = σ ⊗ H(sigmoid(M), λ_m) + H(τ, λ_1) [+ H(τ̃, λ_1)].

    cifar100_apd.py ``build_model_test`` (147-220): τ̃ and τ are thresholded separately, each with ``l1_hyp``
    (165-166 + 168-170 for a clustered multi-member task; 174-175 otherwise; same at 197-202, 207-208); the mask is
    thresholded after the sigmoid with ``mask_hyp`` (179, 212; mask_hyp = 0 in both bash scripts, so sigmoid(M) > 0
    always survives); forward weight ``sw * pruned_m + pruned_aw`` (180, 213). σ itself is never thresholded.
    ``threshold`` is the code's l1_hyp, i.e. the same number as the L1 coefficient λ_1.
    """
    out = sigma * _gate(hard_threshold(torch.sigmoid(mask_logits), mask_threshold), sigma)
    out = out + hard_threshold(tau, threshold)
    if shared is not None:
        out = out + hard_threshold(shared, threshold)
    return out


def l2_loss(x):
    """tf.nn.l2_loss: ½ Σ x² (no square root, no mean)."""
    return 0.5 * (x * x).sum()


def loss_terms(task, sigma, masks, taus, shared, refs, lam_wd, lam_1, lam_2, lam_m=0.0):  # noqa: PLR0917 (fixed API)
    """Regulariser terms of ONE layer while training task ``task`` (0-based), cifar100_apd.py ``build_model``.

    Returns (the cross-entropy is not included; the code's total is CE + wd + sparsity + drift, 342-345, where the
    code's ``sparseness`` variable = our "sparsity" + "past_sparsity"):

    * "wd"  = λ_wd·(ℓ2(τ_t) + ℓ2(M_t) + [t==0]·ℓ2(σ))   (240-241, 245-246; 297-298, 302-303). ℓ2 is on the raw
      mask LOGITS M_t, not on sigmoid(M_t). σ is weight-decayed only in task 0.
    * "sparsity" = λ_1‖τ_t‖₁ + λ_m‖M_t‖₁                (242-243; 299-300), again on the raw logits.
    * "drift" = Σ_{j<t} λ_2·ℓ2(θ_j − ref_j), θ_j = σ⊗sig(M_j) + τ_j [+ τ̃_{g(j)}] with the CURRENT σ
      (273-276; 330-333). ref_j = ``theta_t.eval()`` taken when task t's graph is built, i.e. θ_j as loaded from
      the end of task t−1 (after any consolidation), a constant.
    * "past_sparsity" = Σ_{j<t} λ_1‖τ_j‖₁ (277; 334): only τ_j (``paw``), never τ̃, and no mask term for j < t.

    Biases: the per-task biases ``task{t}/biases/layer{l}`` (27, 36) and the head ``topmost_weights/biases``
    (338-339) enter NO regulariser term (not wd, not L1, not drift); only the forward/CE uses them.

    Arguments: masks[j], taus[j] for j = 0..task; shared[j] = τ̃ of task j's cluster or None (shared may be None
    as a whole; shared[task], if present, is unused: the current task is never clustered, since local_id =
    floor(t/5)·5 ≤ t, cifar100_apd.py:22); refs[j] for j < task.
    """
    M_t, tau_t = masks[task], taus[task]
    wd = l2_loss(tau_t) + l2_loss(M_t)
    if task == 0:
        wd = wd + l2_loss(sigma)
    sparsity = lam_1 * tau_t.abs().sum() + lam_m * M_t.abs().sum()
    drift = sigma.new_zeros(())
    past_sparsity = sigma.new_zeros(())
    for j in range(task):
        s_j = None if shared is None else shared[j]
        drift = drift + lam_2 * l2_loss(theta(sigma, masks[j], taus[j], s_j) - refs[j])
        past_sparsity = past_sparsity + lam_1 * taus[j].abs().sum()
    return {"wd": lam_wd * wd, "sparsity": sparsity, "drift": drift, "past_sparsity": past_sparsity}


def num_clusters(tasks_done, k_centroids=2, every=5):
    """k for the k-means round run after ``tasks_done`` tasks: int(k_centroides·(tid+1)/clustering_iter).

    cifar100_apd.py ``k_means_clustering`` line 352 (tid+1 = tasks_done); rounds are run only when
    (idx+1) % clustering_iter == 0 (cifar100_apd_run.py:121), so k = 2, 4, 6, ... after 5, 10, 15, ... tasks.
    """
    if tasks_done <= 0 or tasks_done % every != 0:
        raise ValueError(f"no consolidation round after {tasks_done} tasks (every={every})")
    return int(k_centroids * tasks_done / every)


def consolidate(full_taus, labels, e_gap):
    """One layer's local-shared decomposition, cifar100_apd.py ``aw_consolidation`` (411-445).

    full_taus[j] = τ_j + its current τ̃ (the code's ``full_aw``, built in ``k_means_clustering`` 360-376);
    labels[j] = cluster of task j (per layer). For each cluster c:

    * one member (417-424): no τ̃; the member's τ_j is overwritten by its full tensor (``only.assign(full)``), so an
      earlier τ̃ is folded into τ_j and θ_j is unchanged.
    * ≥ 2 members (426-441): gap = max_j − min_j elementwise; e_nind = 1[gap > e_gap] (strict), e_ind = 1 − e_nind;
      τ̃_c = ½(max + min)·e_ind (``reduce_mean([e_max, e_min], 0) * e_ind``); each member τ_j ← full_j·e_nind.
      Hence |τ̃_c + τ_j(new) − full_j| ≤ gap/2 ≤ e_gap/2 elementwise, and exactly 0 where gap > e_gap.

    Clusters with no member are skipped here (the code would still create an unused scalar ``aw_group``).
    Returns ({cluster: τ̃_c for clusters with ≥ 2 members}, [new τ_j for every task j]).
    """
    assert len(full_taus) == len(labels)
    new_taus: list[torch.Tensor | None] = [None] * len(full_taus)
    shared: dict[int, torch.Tensor] = {}
    for c in sorted(set(int(x) for x in labels)):
        members = [j for j, lab in enumerate(labels) if int(lab) == c]
        if len(members) == 1:
            new_taus[members[0]] = full_taus[members[0]].clone()
            continue
        stack = torch.stack([full_taus[j] for j in members])
        e_max, e_min = stack.max(0).values, stack.min(0).values
        e_nind = ((e_max - e_min) > e_gap).to(stack.dtype)
        e_ind = (1 - e_nind).abs()
        shared[c] = 0.5 * (e_max + e_min) * e_ind
        for j in members:
            new_taus[j] = full_taus[j] * e_nind
    return shared, new_taus


def kmeans(full_aws, k, shuffle, prv_cent=None, steps=100):
    """One layer's k-means, cifar100_apd.py ``k_means_clustering`` (349-409), on the flattened tensors ``full_aws``
    (a list of n 1-D tensors, the code's ``full_aw``).

    * init (378-389): ``rs_aws = tf.random_shuffle(full_aw)`` (the order given here as ``shuffle``, a permutation of
      0..n-1), centroids = its first k rows; with ``prv_cent`` (the previous round's centroids of this layer, k' rows,
      cifar100_apd_run.py:122-123 passes ``cent_list``) rows 0..k'-1 are replaced by them (``slc[:n_prv_cents] =
      prv_cent[-1][i]``).
    * 100 ``sess.run([update_centroides, centroides, assignments])`` (399-401): ``assignments`` = argmin over centroids of
      the squared distance (392-395), ``means`` = tf.reduce_mean of each cluster's members (396), assigned to the
      centroids. A cluster with no member gets reduce_mean of an empty set, NaN; tf.argmin then never picks it (a NaN
      distance is never smaller than the running minimum), so it stays empty for good.
    * returned: the last run's ``assignment_values`` (the assignment the last update used) and the centroids after that
      update (the next round's ``prv_cent``).
    """
    points = [a.double() for a in full_aws]
    cents = [points[int(i)].clone() for i in shuffle[:k]]
    if prv_cent is not None:
        for c in range(len(prv_cent)):
            cents[c] = prv_cent[c].double().clone()
    assignment = []
    for _ in range(steps):
        assignment = []
        for x in points:
            best, best_d = 0, None
            for c, cent in enumerate(cents):
                d = float(((x - cent) ** 2).sum())
                if not math.isnan(d) and (best_d is None or d < best_d):
                    best, best_d = c, d
            assignment.append(best)
        new = []
        for c in range(k):
            members = [x for x, a in zip(points, assignment, strict=True) if a == c]
            new.append(sum(members) / len(members) if members else torch.full_like(points[0], float("nan")))
        cents = new
    return assignment, torch.stack(cents)


def code_gradients(grads):
    """cifar100_apd.py ``optimization`` (515-522): every gradient of the trained variables is multiplied by 10 before
    ``AdamOptimizer.apply_gradients``."""
    return [g * 10.0 for g in grads]


def capacity(nonzero_counts, base):
    """The code's "Updated Memory Requirements" = active_m_sum / full_base (cifar100_apd_run.py:129-141, 203).

    Computed after task idx (0-based) is trained, its best epoch restored (118) and any consolidation run (121-124),
    over ``tf.trainable_variables()`` of task idx's TRAINING graph, skipping names containing 'Variable' (the
    k-means centroids):

    * numerator (active_m_sum): count_nonzero(H(v, l1_hyp)) if 'aw' in the name, else count_nonzero(v). So
      thresholded: τ_j (``aw_all``) for ALL tasks j ≤ idx and the local-shared τ̃ (``aw_group``) in the graph; NOT
      thresholded: σ (all four layers), the raw mask logits M_j of ALL tasks j ≤ idx (earlier masks are in the graph
      via create_task_parameters, cifar100_apd.py:118-128), and only the CURRENT task's biases b_idx and head
      (``topmost_weights`` + ``topmost_biases``); earlier tasks' biases and heads are not in the graph and are not
      counted. At a consolidation task after the first round (idx+1 = 10, 15, ...) the previous round's τ̃ are still
      in the graph next to the new ones, so both are counted.
    * denominator (full_base, line 74): 5·5·3·20 + 5·5·20·50 + 3200·800 + 800·500 + 500·n_classes·idx, i.e. the
      conv/FC weights of one network plus idx (not idx+1) head weight matrices; no biases, no masks, no head biases.
    """
    return float(nonzero_counts) / float(base)


if __name__ == "__main__":
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out_d, in_d = 6, 5
    sigma = torch.randn(out_d, in_d, generator=g)

    # theta: τ = 0 and M = +20 reproduce σ; the mask gates whole output rows (and conv filters).
    big = torch.full((out_d,), 20.0)
    assert torch.allclose(theta(sigma, big, torch.zeros_like(sigma)), sigma, atol=1e-6)
    m = torch.randn(out_d, generator=g)
    tau = torch.randn(out_d, in_d, generator=g)
    assert torch.allclose(theta(sigma, m, tau), sigma * torch.sigmoid(m)[:, None] + tau)
    conv = torch.randn(out_d, 3, 2, 2, generator=g)
    assert torch.allclose(theta(conv, m, 0 * conv), conv * torch.sigmoid(m)[:, None, None, None])

    # hard_threshold zeroes exactly the |x| <= c entries (c itself included).
    x = torch.tensor([-0.3, -0.1, 0.0, 0.05, 0.1, 0.1001, 2.0])
    assert torch.equal(hard_threshold(x, 0.1) != 0, torch.tensor([True, False, False, False, False, True, True]))
    assert torch.equal(hard_threshold(x, 0.1)[x.abs() > 0.1], x[x.abs() > 0.1])

    # test_theta: thresholds τ and τ̃ separately; threshold 0 on dense tensors equals theta.
    sh = torch.randn(out_d, in_d, generator=g)
    assert torch.allclose(test_theta(sigma, m, tau, sh, 0.0), theta(sigma, m, tau, sh))
    t_small = torch.full_like(tau, 0.01)
    assert torch.allclose(test_theta(sigma, m, t_small, -t_small, 0.02), sigma * torch.sigmoid(m)[:, None])
    assert torch.allclose(test_theta(sigma, m, tau, None, 0.5, mask_threshold=1.0), hard_threshold(tau, 0.5))

    # l2_loss and loss_terms.
    assert float(l2_loss(torch.tensor([3.0, 4.0]))) == 12.5
    masks = [torch.randn(out_d, generator=g) for _ in range(3)]
    taus = [torch.randn(out_d, in_d, generator=g) for _ in range(3)]
    t0 = loss_terms(0, sigma, masks[:1], taus[:1], None, [], 1e-4, 4e-4, 100.0, lam_m=0.5)
    want_wd = 1e-4 * (l2_loss(taus[0]) + l2_loss(masks[0]) + l2_loss(sigma))
    assert torch.allclose(t0["wd"], want_wd)
    assert torch.allclose(t0["sparsity"], 4e-4 * taus[0].abs().sum() + 0.5 * masks[0].abs().sum())
    assert float(t0["drift"]) == 0.0 and float(t0["past_sparsity"]) == 0.0
    shared = [sh, None, None]
    refs = [theta(sigma, masks[0], taus[0], sh), theta(sigma, masks[1], taus[1])]
    t2 = loss_terms(2, sigma, masks, taus, shared, refs, 1e-4, 4e-4, 100.0)
    assert torch.allclose(t2["wd"], 1e-4 * (l2_loss(taus[2]) + l2_loss(masks[2])))
    assert float(t2["drift"]) == 0.0
    assert torch.allclose(t2["past_sparsity"], 4e-4 * (taus[0].abs().sum() + taus[1].abs().sum()))
    moved = loss_terms(2, sigma + 0.1, masks, taus, shared, refs, 1e-4, 4e-4, 100.0)["drift"]
    want = sum(100.0 * l2_loss(0.1 * torch.sigmoid(masks[j])[:, None].expand(out_d, in_d)) for j in range(2))
    assert torch.allclose(moved, want)

    # num_clusters.
    assert [num_clusters(n) for n in (5, 10, 15, 20)] == [2, 4, 6, 8]
    try:
        num_clusters(7)
    except ValueError:
        pass
    else:
        raise AssertionError("num_clusters(7) must raise")

    # consolidate: near-equal members -> reconstruction error <= e_gap/2; far entries kept exactly; singletons intact.
    e_gap = 1e-2
    base = torch.randn(out_d, in_d, generator=g)
    full = [base + 0.009 * torch.rand(out_d, in_d, generator=g) for _ in range(3)]
    full[1][0, 0] += 1.0  # one entry with a large gap
    full.append(torch.randn(out_d, in_d, generator=g))  # a singleton cluster
    labels = [0, 0, 0, 1]
    sh_c, new = consolidate(full, labels, e_gap)
    assert set(sh_c) == {0}
    for j in range(3):
        rec = sh_c[0] + new[j]
        assert float((rec - full[j]).abs().max()) <= e_gap / 2 + 1e-6
        assert float(rec[0, 0]) == float(full[j][0, 0]) and float(sh_c[0][0, 0]) == 0.0
        assert int((new[j] != 0).sum()) == 1
    assert torch.equal(new[3], full[3])
    # kmeans: the shuffle's first k are the centroids; a far warm-start centroid stays empty (NaN) for good.
    pts = [torch.tensor([0.0, 0.0]), torch.tensor([0.1, 0.0]), torch.tensor([5.0, 5.0])]
    assert kmeans(pts, 2, torch.tensor([0, 2, 1]))[0] == [0, 0, 1]
    lab, cen = kmeans(pts, 2, torch.tensor([0, 2, 1]), prv_cent=torch.tensor([[99.0, 99.0]]))
    assert lab == [1, 1, 1] and bool(cen[0].isnan().all())
    print("apd_reference self-check OK")
