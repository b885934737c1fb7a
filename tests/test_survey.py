"""The rest of the mask-based survey (KSM, TFM, APD, CTR) against independent transcriptions of their specs
(tests/oracles/*_reference.py, written from METHODS.md §9 and the official code without reading clbench's)."""

from __future__ import annotations

import pytest
import torch

from clbench.errors import ConfigError
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.apd import APD, code_kmeans, consolidate
from clbench.methods.ctr import CTR, Plugin, ctr_annealed_s
from clbench.methods.hat import capacity
from clbench.methods.ksm import KSM, binary_part, soft_mask
from clbench.methods.tfm import TFM, pack_states, unpack_states
from conftest import tiny_config
from oracles import apd_reference as apd_ref
from oracles import ctr_reference as ctr_ref
from oracles import ksm_reference as ksm_ref
from oracles import tfm_reference as tfm_ref


def started(name: str, *overrides: str, tasks: int = 1):
    """A method on the tiny setting with its first ``tasks`` tasks started (all but the last finished untrained)."""
    method, rt = build_runtime(tiny_config(f"method={name}", *overrides))
    for task in rt.benchmark.tasks[:tasks]:
        if task.id:
            method.after_task(rt.benchmark.tasks[task.id - 1])
        method.before_task(task)
    return method, rt


def randomised(params: list[torch.Tensor], seed: int, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * scale)


# ------------------------------------------------------------------------------------------------------------- KSM
@pytest.mark.parametrize(("temperature", "alpha", "init"), [(0.1, 1.0, 2.0), (0.5, 0.3, -1.0), (2.0, 0.0, 0.5)])
def test_ksm_soft_mask_and_its_gradient_are_the_transcribed_ones_without_straight_through(
    temperature: float, alpha: float, init: float
) -> None:
    """Eqs. 4-8 as reconstructed: M = M^b + A^s; the gradient reaching M^r is the hand-derived chain rule (an STE would
    pass dL/dM unchanged)."""
    real = (torch.randn(6, 5, dtype=torch.float64) * 2).requires_grad_()
    mask = soft_mask(real, temperature, alpha, init)
    torch.testing.assert_close(mask, ksm_ref.soft_mask(real.detach(), temperature, alpha, init), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(binary_part(real, temperature), ksm_ref.binary_part(real.detach(), temperature))
    upstream = torch.randn(6, 5, dtype=torch.float64)
    (grad,) = torch.autograd.grad(mask, real, upstream)
    expected = ksm_ref.mask_grad(real.detach(), upstream, temperature, alpha, init)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(grad, upstream)


@pytest.mark.parametrize("group", [1, 4])
def test_ksm_masks_each_kernel_as_transcribed_and_starts_from_the_backbone(group: int) -> None:
    """A Linear's mask has one value per (row, g input columns), the patch embedding's one per (c_out, c_in) kernel;
    at task start (M^r = m0) the masked backbone differs from the frozen one only by M^b(m0)'s distance from 1."""
    method, rt = started("ksm", f"method.group={group}", "method.layers=[patch_embed.proj,attn.qkv,mlp.fc2]")
    cfg = method.config
    x = rt.test_tf(rt.benchmark.test[0].x[:4])
    with torch.no_grad():
        plain = method.backbone.forward_head(method.backbone.forward_features(x), pre_logits=True)
        torch.testing.assert_close(method.features(x, 0), plain, rtol=0, atol=5e-3)
    randomised(list(method.scores.values()), seed=1, scale=2.0)
    for name, layer in method.layers.items():
        real = method.scores[name.replace(".", "_")].detach()
        masked = layer.weight * method.mask_for(name, 0)
        if name == "patch_embed.proj":
            assert real.shape == layer.weight.shape[:2]
            expected = ksm_ref.conv_weight(layer.weight, real, cfg.temperature, cfg.alpha, cfg.init)
        else:
            assert real.shape == (layer.weight.shape[0], layer.weight.shape[1] // group)
            expected = ksm_ref.linear_weight(layer.weight, real, group, cfg.temperature, cfg.alpha, cfg.init)
        torch.testing.assert_close(masked, expected, rtol=1e-6, atol=1e-7)


def test_ksm_keeps_a_float16_soft_mask_per_kernel_and_refuses_a_group_that_does_not_divide() -> None:
    method, rt = started("ksm", "method.group=2")
    assert isinstance(method, KSM)
    real = {k: v.detach().clone() for k, v in method.scores.items()}
    method.after_task(rt.benchmark.tasks[0])
    for name in method.layers:
        stored = method.kernel_mask(name, 0)
        assert stored.dtype == torch.float16
        cfg = method.config
        expected = ksm_ref.soft_mask(real[name.replace(".", "_")], cfg.temperature, cfg.alpha, cfg.init)
        assert torch.equal(stored, expected.half())
    with pytest.raises(ConfigError, match=r"`method.group`: 5. Allowed: a divisor of every masked Linear's input"):
        started("ksm", "method.group=5")  # TINY's widths: 32 (qkv, fc1) and 128 (fc2)


# ------------------------------------------------------------------------------------------------------------- TFM
def oracle_params(method: TFM, block: int) -> dict:
    """The tensors of ``block`` in the oracle's layout."""
    b = method.backbone.blocks[block]
    mlp = b.mlp
    return {
        "norm1_w": list(b.norm1.weights),
        "norm1_b": list(b.norm1.biases),
        "norm2_w": list(b.norm2.weights),
        "norm2_b": list(b.norm2.biases),
        "qkv_w": b.attn.qkv.weight,
        "qkv_b": b.attn.qkv.bias,
        "proj_w": b.attn.proj.weight,
        "proj_b": b.attn.proj.bias,
        "fc1_w": mlp.mlp.fc1.weight,
        "fc1_b": mlp.mlp.fc1.bias,
        "fc2_w": mlp.mlp.fc2.weight,
        "fc2_b": mlp.mlp.fc2.bias,
        "grown": list(zip(mlp.w1, mlp.b1, mlp.w2, strict=True)),
    }


@pytest.mark.parametrize("reuse", ["all", "own"])
def test_tfm_block_is_the_transcribed_one_for_every_task(reuse: str) -> None:
    """Per-task LayerNorms, the pretrained units and the grown units each task's ternary state uses."""
    method, _ = started("tfm", f"method.reuse={reuse}", "backbone.kwargs.depth=2", tasks=3)
    randomised([p for t in range(3) for p in (*method.grown(t), *method.affines(t))], seed=2)
    x = torch.randn(2, 5, method.backbone.embed_dim)
    for task in range(3):
        p = oracle_params(method, block=1)
        if reuse == "own":  # the oracle's states vector: earlier tasks' units unused (state 0)
            p["states"] = method.states(task, 1)
        with method.task_path(task), torch.no_grad():
            out = method.backbone.blocks[1](x)
        heads = method.backbone.blocks[1].attn.num_heads
        torch.testing.assert_close(out, tfm_ref.block_forward(x, p, task, heads), rtol=1e-5, atol=1e-5)


def test_tfm_states_are_ternary_and_pack_into_two_bits_a_unit() -> None:
    method, _ = started("tfm", tasks=3)
    units = method.units[0]
    pretrained = method.mlps[0].mlp.fc1.out_features
    for task in range(3):
        states = method.states(task, 0)
        assert torch.equal(states, tfm_ref.default_states(pretrained, [units] * 3, task))
        assert torch.equal(pack_states(states), tfm_ref.pack_states(states))
        assert torch.equal(unpack_states(pack_states(states), len(states)), states)
    assert method.storage()["bits_per_task"][2]["masks"] == 2 * (pretrained + 3 * units)


def test_tfm_trains_only_its_units_norms_and_head_and_starts_at_the_previous_tasks_function() -> None:
    """A new task's fc2 columns are zero and its LayerNorms copies of the task before: its features are that task's;
    what it trains is the oracle's count."""
    method, rt = started("tfm", tasks=2)
    randomised([*method.grown(0), *method.affines(0)], seed=3)
    task = rt.benchmark.tasks[1]
    for norm in method.norms:  # task 1's affines as task 0's now are
        with torch.no_grad():
            norm.weights[1].copy_(norm.weights[0])
            norm.biases[1].copy_(norm.biases[0])
    x = rt.test_tf(rt.benchmark.test[1].x[:4])
    with torch.no_grad():
        assert torch.allclose(method.features(x, 1), method.features(x, 0), atol=1e-6)
    groups = method.param_groups(task, method.phases(task, 1)[0])
    trained = sum(p.numel() for g in groups for p in g["params"])
    d, blocks = method.backbone.embed_dim, len(method.backbone.blocks)
    assert trained == tfm_ref.trainable_count(d, method.units[0], blocks, task.num_classes, len(method.norms))
    assert trained == sum(p.numel() for p in method.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------------------- APD
def apd_started(*overrides: str, tasks: int = 3) -> tuple[APD, object]:
    """APD with ``tasks`` tasks started and every decomposed tensor random (so each term is non-trivial)."""
    method, rt = started("apd", *overrides, tasks=tasks)
    for layer in method.layers.values():
        randomised([*layer.masks, *layer.taus, layer.sigma], seed=4, scale=0.05)
    return method, rt


def test_apd_forward_is_the_decomposition_in_training_and_the_thresholded_one_at_test() -> None:
    method, rt = apd_started("method.l1=0.04")
    layer = method.layers["blocks.0.mlp.fc1"]
    for task in range(3):
        train = apd_ref.theta(layer.sigma, layer.masks[task], layer.taus[task])
        test = apd_ref.test_theta(layer.sigma, layer.masks[task], layer.taus[task], None, 0.04)
        torch.testing.assert_close(layer.theta(task), train)
        torch.testing.assert_close(layer.theta(task, test=True), test)
        assert not torch.equal(train, test)  # the threshold bites
    x = rt.test_tf(rt.benchmark.test[0].x[:3])
    method.eval()
    with torch.no_grad():
        before = method.features(x, 0)
        layer.taus[0].mul_(layer.taus[0].abs() > 0.04)  # what the test-time threshold drops changes nothing at test
        assert torch.equal(method.features(x, 0), before)


@pytest.mark.parametrize("task", [0, 2])
def test_apd_regulariser_is_the_codes_sum_of_terms(task: int) -> None:
    """wd + sparsity + drift + past sparsity of every decomposed layer, against the transcription of build_model."""
    cfg = ("method.l1=1e-3", "method.drift=7.0", "method.wd=1e-2", "method.mask_l1=1e-3")
    method, _ = apd_started(*cfg, tasks=task + 1)  # the references were taken before the tensors were randomised
    expected = torch.zeros(())
    for i, layer in enumerate(method.layers.values()):
        refs = list(getattr(method, f"ref_{i}"))
        terms = apd_ref.loss_terms(
            task, layer.sigma, list(layer.masks), list(layer.taus), None, refs, 1e-2, 1e-3, 7.0, 1e-3
        )
        expected = expected + sum(terms.values())
    torch.testing.assert_close(method.regulariser(task), expected, rtol=1e-5, atol=1e-6)


def test_apd_trains_sigma_the_tasks_tensors_and_every_earlier_tau_and_mask_but_no_earlier_bias_or_head() -> None:
    method, rt = apd_started(tasks=2)
    task = rt.benchmark.tasks[1]
    params = {id(p) for g in method.param_groups(task, method.phases(task, 1)[0]) for p in g["params"]}
    layer = method.layers["blocks.0.attn.qkv"]
    assert {id(layer.sigma), id(layer.taus[0]), id(layer.masks[0]), id(layer.taus[1]), id(layer.biases[1])} <= params
    assert id(layer.biases[0]) not in params and not params & {id(p) for p in method.heads[0].parameters()}
    frozen, _ = apd_started("method.old_masks=freeze", tasks=2)
    groups = frozen.param_groups(task, frozen.phases(task, 1)[0])
    assert id(frozen.layers["blocks.0.attn.qkv"].masks[0]) not in {id(p) for g in groups for p in g["params"]}


def test_apd_consolidation_shares_near_equal_entries_within_half_the_gap() -> None:
    """aw_consolidation against its transcription; every theta_j moves by at most e_gap / 2; k = 2 * tasks / 5."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 4, generator=gen)
    full = [base + torch.randn(6, 4, generator=gen) * s for s in (0.001, 0.004, 0.1, 0.003, 2.0)]
    labels = [0, 0, 1, 0, 1]
    shared, taus = consolidate(full, labels, 1e-2)
    ref_shared, ref_taus = apd_ref.consolidate(full, labels, 1e-2)
    assert shared.keys() == ref_shared.keys()
    for g, tilde in shared.items():
        torch.testing.assert_close(tilde, ref_shared[g])
    for j, tau in enumerate(taus):
        torch.testing.assert_close(tau, ref_taus[j])
        rebuilt = tau + shared.get(labels[j], 0)
        assert float((rebuilt - full[j]).abs().max()) <= 1e-2 / 2 + 1e-7
    assert [apd_ref.num_clusters(n) for n in (5, 10)] == [2, 4]


def test_apd_consolidates_after_every_fifth_task_and_keeps_each_theta_within_half_the_gap() -> None:
    method, rt = apd_started("data.num_tasks=5", "method.e_gap=0.05", tasks=5)
    task = rt.benchmark.tasks[4]
    with torch.no_grad():
        before = {name: [layer.theta(j).clone() for j in range(5)] for name, layer in method.layers.items()}
    method.after_task(task)
    for name, layer in method.layers.items():
        assert layer.tilde.shape[0] == apd_ref.num_clusters(5) + 1  # and the zero row of tasks in no cluster
        for j in range(5):
            assert float((layer.theta(j).detach() - before[name][j]).abs().max()) <= 0.05 / 2 + 1e-6
    assert len(method.capacity) == 5 and float(method.capacity[-1]) > 0  # one a task


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.double(), b.double(), equal_nan=True, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
def test_apd_kmeans_is_the_codes_shuffle_init_warm_start_and_100_iterations(seed: int) -> None:
    """k_means_clustering against its transcription on 10 tasks' small tensors in 3 groups: the first round (k = 2 of 5)
    from the shuffle, the second (k = 4 of 10) warm-started from the first's centroids."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, 12, generator=gen)
    points = centres[torch.randint(3, (10,), generator=gen)] + 0.3 * torch.randn(10, 12, generator=gen)
    torch.manual_seed(seed)
    labels, centroids = code_kmeans(points[:5], 2)
    torch.manual_seed(seed)
    ref_labels, ref_centroids = apd_ref.kmeans(list(points[:5]), 2, torch.randperm(5))
    assert labels == ref_labels
    nan_equal(centroids, ref_centroids)
    torch.manual_seed(seed + 100)
    labels, centroids = code_kmeans(points, 4, previous=ref_centroids.float())
    torch.manual_seed(seed + 100)
    ref_labels, ref_centroids = apd_ref.kmeans(list(points), 4, torch.randperm(10), prv_cent=ref_centroids)
    assert labels == ref_labels
    nan_equal(centroids, ref_centroids)


def test_apd_kmeans_leaves_an_emptied_cluster_empty() -> None:
    """A warm-start centroid far from every task's tensor wins no member: its mean is NaN and it stays empty, where
    k-means++ would fill it."""
    points = torch.tensor([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0], [5.0, 5.1]])
    previous = torch.tensor([[100.0, 100.0]])
    torch.manual_seed(0)
    labels, centroids = code_kmeans(points, 2, previous=previous)
    torch.manual_seed(0)
    ref_labels, ref_centroids = apd_ref.kmeans(list(points), 2, torch.randperm(5), prv_cent=previous)
    assert labels == ref_labels and 0 not in labels
    assert torch.isnan(centroids[0]).all()
    nan_equal(centroids, ref_centroids)


@pytest.mark.parametrize("kmeans", ["code", "sklearn"])
def test_apd_consolidation_clusters_with_the_chosen_kmeans(kmeans: str) -> None:
    """kmeans=code: each layer's round is the code's k-means of its tasks' full tau (the shuffles drawn layer by layer),
    and its centroids are kept for the next round's warm start; kmeans=sklearn keeps none."""
    method, rt = apd_started("data.num_tasks=5", f"method.kmeans={kmeans}", tasks=5)
    with torch.no_grad():
        full = {
            name: torch.stack([la.taus[j] + la.shared(j) for j in range(5)]).flatten(1)
            for name, la in method.layers.items()
        }
    torch.manual_seed(3)
    method.after_task(rt.benchmark.tasks[4])
    if kmeans == "sklearn":
        assert all(len(layer.centroids) == 0 for layer in method.layers.values())
        return
    torch.manual_seed(3)
    for name, layer in method.layers.items():
        _, ref_centroids = apd_ref.kmeans(list(full[name]), 2, torch.randperm(5))
        nan_equal(layer.centroids.flatten(1), ref_centroids)


def test_apd_keeps_its_kmeans_centroids_with_the_run_for_the_next_rounds_warm_start() -> None:
    """The centroids a round ends with travel in the artifacts (and checkpoints), so a resumed or re-evaluated run
    warm-starts its next round from them."""
    method, rt = apd_started("data.num_tasks=5", tasks=5)
    method.after_task(rt.benchmark.tasks[4])
    fresh, _ = build_runtime(tiny_config("method=apd", "data.num_tasks=5"))
    fresh.load_artifacts(method.artifacts())
    for name, layer in method.layers.items():
        assert len(layer.centroids) == 2
        nan_equal(fresh.layers[name].centroids, layer.centroids)


@pytest.mark.parametrize("scale", [10.0, 1.0])
def test_apd_scales_every_gradient_before_adam_as_the_code(scale: float) -> None:
    """grad_scale=10 (the code's x10) multiplies every trained gradient; through Adam (epsilon 1e-8) a coordinate whose
    gradient is 1e-9 then moves lr * 1e-8 / (1e-8 + 1e-8) = lr / 2 on its first step, not lr * 1e-9 / 1.1e-8 =
    lr / 11."""
    method, rt = apd_started(f"method.grad_scale={scale}", tasks=1)
    task = rt.benchmark.tasks[0]
    params = [p for g in method.param_groups(task, method.phases(task, 1)[0]) for p in g["params"]]
    method.train()
    loss, _ = method.training_loss(rt.train_tf(rt.benchmark.train[0].x[:4]), rt.benchmark.train[0].y[:4], task)
    loss.backward()
    grads = [p.grad.clone() for p in params]
    method.after_backward(task)
    for p, g in zip(params, apd_ref.code_gradients(grads) if scale == 10 else grads, strict=True):
        torch.testing.assert_close(p.grad, g)
    sigma = method.layers["blocks.0.mlp.fc1"].sigma
    optimizer = torch.optim.Adam([sigma], lr=1e-3, eps=1e-8)
    before = sigma.detach().clone()
    sigma.grad = torch.full_like(sigma, 1e-9)
    method._trained = [sigma]
    method.after_backward(task)
    optimizer.step()
    step = 1e-3 * (1e-9 * scale) / (1e-9 * scale + 1e-8)
    torch.testing.assert_close(before - sigma.detach(), torch.full_like(sigma, step), rtol=1e-4, atol=0)


def test_apd_capacity_is_over_the_codes_base_one_network_and_every_head_but_the_newest() -> None:
    """cifar100_apd_run.py's full_base after task idx: the decomposed weights plus idx head weight matrices
    (500 n idx)."""
    method, _ = apd_started("method.l1=0.04", tasks=2)
    kept = sum(
        int(la.sigma.count_nonzero())
        + sum(int(m.count_nonzero()) + b.numel() for m, b in zip(la.masks, la.biases, strict=True))
        + sum(int((t.abs() > 0.04).sum()) for t in la.taus)
        for la in method.layers.values()
    ) + sum(p.numel() for h in method.heads for p in h.parameters())
    base = sum(la.sigma.numel() for la in method.layers.values()) + method.heads[0].weight.numel()  # idx = 1
    assert method.current_capacity() == pytest.approx(apd_ref.capacity(kept, base))


def test_apd_others_shared_trains_the_rest_of_the_backbone_and_results_say_so() -> None:
    """others=shared (a ViT from scratch): the embeddings, cls token and LayerNorms train with every task, and storage
    and results.json count them; others=frozen (the default) trains none of them."""
    for others in ("frozen", "shared"):
        method, rt = apd_started(f"method.others={others}", tasks=2)
        task = rt.benchmark.tasks[1]
        trained = {id(p) for g in method.param_groups(task, method.phases(task, 1)[0]) for p in g["params"]}
        rest = [method.backbone.patch_embed.proj.weight, method.backbone.pos_embed, method.backbone.cls_token]
        rest += list(method.backbone.blocks[0].norm1.parameters()) + list(method.backbone.norm.parameters())
        assert all((id(p) in trained) == (others == "shared") for p in rest)
        numel = sum(p.numel() for p in method.others)
        assert numel >= sum(p.numel() for p in rest)
        assert method.extra_results()["apd"]["others"] == others
        assert method.storage()["shared_bits"].get("others") == (32 * numel if others == "shared" else None)


@pytest.mark.parametrize(
    ("override", "key"), [("method.layers=[attn.nope]", "layers"), ("method.mask_init=nan", "mask_init")]
)
def test_apd_refuses_a_layer_that_is_no_block_linear_and_a_non_finite_mask_init(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"method.{key}"):
        tiny_config("method=apd", override)


def test_apd_drift_of_an_earlier_task_falls_as_its_penalty_grows() -> None:
    """The retroactive penalty l_2 holds theta_0 to its reference while sigma trains on task 1."""
    drifts = []
    for drift in (0.0, 100.0, 10000.0):
        method, rt = build_runtime(tiny_config("method=apd", f"method.drift={drift}", "trainer.lr=1e-2"))
        for task in rt.benchmark.tasks[:2]:
            method.before_task(task)
            run_task(method, task, rt, epochs=2)
            method.after_task(task)
        refs = {i: getattr(method, f"ref_{i}")[0] for i in range(len(method.layers))}
        drifts.append(
            sum(float((la.theta(0).detach() - refs[i]).norm()) for i, la in enumerate(method.layers.values()))
        )
    assert drifts[0] > drifts[1] > drifts[2], drifts


# ------------------------------------------------------------------------------------------------------------- CTR
def ctr_params(method: CTR, plugin: Plugin, key: str) -> dict:
    """One plugin's tensors (and every started task's gate embeddings) in the oracle's layout."""
    ksm = plugin.ksm
    p = {
        "caps_w": torch.stack([c.weight for c in ksm.capsules]),
        "caps_b": torch.stack([c.bias for c in ksm.capsules]),
        "route_w": torch.stack(list(ksm.routes), dim=1),
        "fc_cur_w": ksm.mix.weight,
        "fc_cur_b": ksm.mix.bias,
        "fc_sim_w": ksm.weigh.weight,
        "fc_sim_b": ksm.weigh.bias,
        "gate_w": ksm.gate.weight,
        "gate_b": ksm.gate.bias,
        "larger_w": ksm.out.weight,
        "larger_b": ksm.out.bias,
        "fc1_w": plugin.fc1.weight,
        "fc1_b": plugin.fc1.bias,
        "fc2_w": plugin.fc2.weight,
        "fc2_b": plugin.fc2.bias,
        "e1": torch.stack([e[f"{key}_fc1"] for e in method.embeddings]),
        "e2": torch.stack([e[f"{key}_fc2"] for e in method.embeddings]),
    }
    for i, k in enumerate(ctr_ref.KERNELS):
        p |= {f"cur_conv_w{k}": ksm.current[i].weight, f"cur_conv_b{k}": ksm.current[i].bias}
        p |= {f"task_conv_w{k}": ksm.per_task[i].weight, f"task_conv_b{k}": ksm.per_task[i].bias}
    return p


def ctr_started(*overrides: str, tasks: int = 3) -> CTR:
    method, _ = started("ctr", "method.channels=6", "method.adapter_size=8", *overrides, tasks=tasks)
    randomised([p for plugin in method.plugins for p in plugin.parameters()], seed=6, scale=0.3)
    return method


@pytest.mark.parametrize("task", [0, 1, 2])
def test_ctr_plugin_is_the_transcribed_one_at_eval_and_with_the_same_gumbel_draws_in_training(task: int) -> None:
    """KSM (capsules, routing, similarity, hard gate, KS-layer) and the HAT-gated TSM against ctr_reference, the
    argmax gate at eval; in training the same Gumbel noise as torch's gumbel_softmax draws."""
    method = ctr_started()
    plugin, key = method.plugins[1], "blocks_0_mlp"
    z = torch.randn(2, 7, method.backbone.embed_dim, generator=torch.Generator().manual_seed(7))
    p = ctr_params(method, plugin, key)
    s = method.config.s_max
    method.eval()
    with torch.no_grad():
        gates = method.gates(task, s)
        for gate_key, layer in method.gated.items():  # the KS-layer's gates (ks_gate) gate no layer, as in the code
            layer.gate = gates[gate_key]
        plugin.ksm.task = task
        torch.testing.assert_close(plugin(z), ctr_ref.plugin(z, task, p, s), rtol=1e-5, atol=1e-5)
        method.train()
        torch.manual_seed(8)
        mine = plugin(z)
        torch.manual_seed(8)
        noise = -torch.empty(2, task + 1, 2).exponential_().log()
        noise = torch.cat([noise, torch.zeros(2, 2 - task, 2)], 1)  # tasks after t never reach the output
        torch.testing.assert_close(mine, ctr_ref.plugin(z, task, p, s, gate_noise=noise), rtol=1e-5, atol=1e-5)


def test_ctr_guards_the_tsm_with_the_transcribed_hat_masks_and_anneals_as_the_code() -> None:
    method = ctr_started()
    gen = torch.Generator().manual_seed(9)
    for key in method.units:  # cumulative gates of earlier tasks: saturated and soft entries
        method.cumulative(key).copy_(torch.rand(method.units[key], generator=gen).round())
    plugin, key = method.plugins[0], "blocks_0_attn"
    expected = ctr_ref.grad_masks(method.cumulative(f"{key}_fc1"), method.cumulative(f"{key}_fc2"))
    guarded = {id(p.param): method.multiplier(p) for p in method.protected}
    for name in ("fc1_w", "fc1_b", "fc2_w", "fc2_b"):
        layer = plugin.fc1 if name.startswith("fc1") else plugin.fc2
        param = layer.weight if name.endswith("_w") else layer.bias
        torch.testing.assert_close(guarded[id(param)].expand_as(param), expected[name])
    gates = [g for g in method.gates(2, 3.0).values()]
    previous = [method.cumulative(k) for k in method.units]
    torch.testing.assert_close(capacity(gates, previous), ctr_ref.capacity_regulariser(gates, previous))


@pytest.mark.parametrize("ksm", ["shared", "frozen"])
def test_ctr_trains_the_capsules_the_code_does_and_never_a_future_tasks(ksm: str) -> None:
    """shared (the code's tsv mask): every capsule and routing of tasks <= t, the estimator and the KS-layer; frozen:
    the task's own capsule and routing only. A future task's capsule gets no gradient either way."""
    method = ctr_started(f"method.ksm={ksm}", tasks=2)
    task = method.tasks[1]
    groups = method.param_groups(task, method.phases(task, 1)[0])
    trained = {id(p) for g in groups for p in g["params"]}
    ksm_module = method.plugins[0].ksm
    assert {id(p) for p in ksm_module.own(1)} <= trained
    assert ({id(p) for p in ksm_module.own(0)} <= trained) == (ksm == "shared")
    assert ({id(p) for p in ksm_module.estimator()} <= trained) == (ksm == "shared")
    assert not {id(p) for p in ksm_module.own(2)} & trained
    method.train()
    x = torch.randn(4, 3, 16, 16)
    loss, _ = method.training_loss(x, torch.tensor([2, 3, 2, 3]), task)
    loss.backward()
    assert all(p.grad is None for p in ksm_module.own(2))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ksm_module.own(1))


def test_ctr_anneals_by_batch_index_as_its_code_not_by_hats_sample_index() -> None:
    """PyContinual's s = (s_max - 1/s_max) step / len(loader) + 1/s_max: at the last of 32 batches of 1,000 samples
    (batch 32) that is 399.9975 * 31 / 32 + 0.0025 = 387.5; HAT's sample-index 992 / 1000 would give 396.8."""
    method = ctr_started(tasks=1)
    task = method.tasks[0]
    method.before_epoch(task, 1000, 32)
    for batch in (0, 16, 31):
        method.before_step(task, batch, 32)
        assert float(method.s) == pytest.approx(ctr_ref.anneal(batch, 32), rel=1e-6)
        assert ctr_annealed_s(batch, 32, 400.0) == pytest.approx(ctr_ref.anneal(batch, 32), rel=1e-12)
    assert float(method.s) == pytest.approx(387.5, abs=1e-3)


def ctr_reg(method: CTR, task: int) -> float:
    method.train()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return float(method.training_loss(x, torch.tensor([0, 1, 0, 1]) + 2 * task, method.tasks[task])[1]["capacity_reg"])


@pytest.mark.parametrize("ks_gate", [True, False])
def test_ctr_ks_layer_gates_enter_the_regulariser_and_guard_the_ks_layer_as_the_code(ks_gate: bool) -> None:
    """ks_gate=true: every plugin's elarger gate sigmoid(s e3) is one more term of the transcribed regulariser, and the
    KS-layer's rows take 1 - its cumulative gate; false: only g1, g2 and no guard on the KS-layer."""
    method = ctr_started(f"method.ks_gate={ks_gate}")
    gen = torch.Generator().manual_seed(9)
    for key in method.units:
        method.cumulative(key).copy_(torch.rand(method.units[key], generator=gen))
    method.s.fill_(3.0)
    gates, previous = [], []
    for i, plugin in enumerate(method.plugins):
        key = f"blocks_{i // 2}_{('attn', 'mlp')[i % 2]}"
        p = ctr_params(method, plugin, key)
        gates += list(ctr_ref.hat_gates(p, 2, 3.0))
        previous += [method.cumulative(f"{key}_fc1"), method.cumulative(f"{key}_fc2")]
        if ks_gate:
            gates.append(ctr_ref.ks_gate(torch.stack([e[f"{key}_ks"] for e in method.embeddings]), 2, 3.0))
            previous.append(method.cumulative(f"{key}_ks"))
            guard = {id(g.param): method.multiplier(g) for g in method.protected}
            expected = ctr_ref.ks_grad_masks(method.cumulative(f"{key}_ks"), plugin.ksm.out.in_features)
            torch.testing.assert_close(
                guard[id(plugin.ksm.out.weight)].expand_as(plugin.ksm.out.weight), expected["larger_w"]
            )
            torch.testing.assert_close(guard[id(plugin.ksm.out.bias)], expected["larger_b"])
        else:
            assert id(plugin.ksm.out.weight) not in {id(g.param) for g in method.protected}
    expected = float(ctr_ref.capacity_regulariser(gates, previous).detach())
    assert ctr_reg(method, 2) == pytest.approx(expected, rel=1e-5)


def test_ctr_closed_ks_layer_gates_scale_the_first_tasks_regulariser_by_r_plus_d_over_r_plus_2d() -> None:
    """Task 0's R = sum(g) / #g: the KS-layer's gates, once closed (e = -6 at s_max), add d units to every plugin's
    r + d and nothing to the sum."""
    regs = {}
    for ks_gate in (True, False):
        method = ctr_started(f"method.ks_gate={ks_gate}", tasks=1)
        with torch.no_grad():
            for key, e in method.embeddings[0].items():
                e.fill_(-6.0 if key.endswith("_ks") else 0.3)
        method.s.fill_(400.0)
        regs[ks_gate] = ctr_reg(method, 0)
    r, d = method.config.adapter_size, method.backbone.embed_dim
    assert regs[True] / regs[False] == pytest.approx((r + d) / (r + 2 * d), rel=1e-6)


def test_ctr_ksm_lr_null_trains_the_ksm_at_the_trainer_lr() -> None:
    """The documented null: the KSM's group takes no lr of its own."""
    method = ctr_started("method.ksm_lr=null", tasks=1)
    task = method.tasks[0]
    groups = method.param_groups(task, method.phases(task, 1)[0])
    ksm = {id(p) for p in method.knowledge_parameters(0)}
    (group,) = [g for g in groups if {id(p) for p in g["params"]} == ksm]
    assert "lr" not in group
