"""HiDe-Prompt and HiDe-LoRA (PTM spec part 2 §4.7) against an independent transcription of the official code
(tests/oracles/hide_reference.py, thu-ml/HiDe-Prompt@0ed4333) on small tensors: the prefix layouts on a labelled pool,
per-image prediction with the correct layout (and the official reshape's batch dependence), the prompt momentum and
slot copy, TII's MLP and task map, L_proto, the per-image LoRA update, multi-centroid statistics and the alignment's
step count; then the phases, settings, storage and refusals of a run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from clbench.data import Task
from clbench.errors import ConfigError
from clbench.loop.resume import finish_untrained
from clbench.loop.runtime import build_runtime
from clbench.methods.hide import HiDe, MlpMapping, grouped_proto_loss, inferred_tasks, prefix_layout, proto_loss
from clbench.methods.parts import gaussian_alignment as ga
from conftest import tiny_config
from oracles import hide_reference as ref

FAST = ("method=hide", "method.tii.epochs=1", "method.tii_alignment.epochs=1", "method.tap_alignment.epochs=1")


def built(*overrides: str, started: int = 0) -> HiDe:
    """A HiDe method of the tiny setup (3 tasks), its first ``started`` tasks through their lifecycle untrained."""
    method, rt = build_runtime(tiny_config(*FAST, *overrides))
    for task in rt.benchmark.tasks[:started]:
        method.before_task(task)
        finish_untrained(method, task)
    method.eval()
    return method


def labelled_pool(method: HiDe) -> None:
    """Slot s's key prefixes hold 10 s, its value prefixes 10 s + 1."""
    with torch.no_grad():
        for s, prompt in enumerate(method.prompts):
            prompt[:, 0], prompt[:, 1] = 10 * s, 10 * s + 1


# ----------------------------------------------------------------------------- 1-2: the prefix layout
def test_the_correct_layout_gives_each_image_its_own_slot_the_official_reshape_mixes_the_batch() -> None:
    ids = torch.tensor([0, 1, 2, 2])
    correct, official = built(), built("method.prefix_layout=official_reshape")
    for method in (correct, official):
        labelled_pool(method)
    got = correct.slot_prompts(ids, None)[0, :, :, 0, 0]  # layer 0, (B, key|value), first position and channel
    assert got.tolist() == [[0, 1], [10, 11], [20, 21], [20, 21]]
    got = official.slot_prompts(ids, None)[0, :, :, 0, 0]
    assert got.tolist() == [[0, 10], [20, 20], [1, 11], [21, 21]]  # [(0,K),(1,K)], [(2,K),(2,K)], [(0,V),(1,V)], ...
    pool = torch.stack(list(official.prompts), dim=2)  # the code's (layers, 2, pool, length, D)
    heads, width = 2, pool.shape[-1]
    code = ref.official_prefixes(pool.unflatten(-1, (heads, width // heads)), ids[:, None])
    torch.testing.assert_close(official.slot_prompts(ids, None), code.flatten(-2))


def test_prefix_layout_of_one_image_is_its_own_in_both() -> None:
    one = torch.arange(8.0).reshape(1, 2, 2, 2)
    assert torch.equal(prefix_layout(one, "official_reshape"), one)


def predictions(method: HiDe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CIL logits of ``x`` as one batch, and of each image alone."""
    alone = torch.cat([method.predict(x[i : i + 1], None) for i in range(len(x))])
    return method.predict(x, None), alone


@pytest.mark.parametrize("peft", ["prompt", "lora"])
def test_with_the_correct_layout_an_images_prediction_does_not_depend_on_its_batch(peft: str) -> None:
    method = built(f"method.peft={peft}", started=2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in method.parameters():
            p.add_(0.3 * torch.randn_like(p))
        if peft == "lora":
            for wrapper in method.lora.wrappers:
                wrapper.bank_b.normal_()
    x = torch.randn(6, 3, 16, 16)
    batch, alone = predictions(method, x)
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)
    assert len(set(method.infer(x).tolist())) == 2  # images of both slots in the batch


def test_the_official_reshape_makes_a_prediction_depend_on_its_batch() -> None:
    method = built("method.prefix_layout=official_reshape", started=2)
    batch, alone = predictions(method, torch.randn(6, 3, 16, 16))
    assert (batch - alone).abs().max() > 1e-3
    assert HiDe.batch_level(method.config) == ["method.prefix_layout"]
    assert HiDe.batch_level(built().config) == []


# ----------------------------------------------------------------------------- 3: slot copy and prompt momentum
def test_a_slot_starts_as_the_previous_one_and_is_stored_as_its_momentum_mixture() -> None:
    method = built(started=2)
    task = method.tasks[2]
    method.before_task(task)
    assert torch.equal(method.prompts[2], method.prompts[1])
    with torch.no_grad():
        for prompt in method.prompts:
            prompt.normal_()
    pool = torch.stack([p.detach().clone() for p in method.prompts], dim=2)  # the code's (layers, 2, pool, L, D)
    mixed = method.slot_prompts(torch.tensor([2]), training=task)[:, 0]  # the training forward's prompt
    method.settle_slot(task)
    want = ref.momentum_prompt(pool, 2, 0.01)[:, :, 2]
    torch.testing.assert_close(method.prompts[2].detach(), want)
    torch.testing.assert_close(mixed.detach(), want)
    mixed.sum().backward()  # the earlier slots' mean enters without gradient
    assert method.prompts[0].grad is None and method.prompts[2].grad is not None


def test_a_lora_slot_is_copied_mixed_and_stored_in_the_bank() -> None:
    method = built("method.peft=lora", started=1)
    wrapper = method.lora.wrappers[0]
    with torch.no_grad():
        wrapper.bank_a[0].normal_()
        wrapper.bank_b[0].normal_()
    method.before_task(method.tasks[1])
    assert torch.equal(wrapper.a, wrapper.bank_a[0]) and torch.equal(wrapper.b, wrapper.bank_b[0])
    with torch.no_grad():
        wrapper.a.normal_()
        wrapper.b.normal_()
    a, b = wrapper.a.detach().clone(), wrapper.b.detach().clone()
    method.settle_slot(method.tasks[1])
    torch.testing.assert_close(wrapper.bank_a[1], 0.9 * a + 0.1 * wrapper.bank_a[0])
    torch.testing.assert_close(wrapper.bank_b[1], 0.9 * b + 0.1 * wrapper.bank_b[0])


# ----------------------------------------------------------------------------- 4-7: TII, L_proto, the LoRA update
def test_the_tii_mlp_is_the_codes_and_with_w1_zero_a_layer_norm() -> None:
    torch.manual_seed(1)
    ours, code = MlpMapping(8, 2, torch.device("cpu")), ref.MlpMapping(8, 2)
    code.net[0][0].load_state_dict(ours.fc1.state_dict())
    code.net[1][0].load_state_dict(ours.fc2.state_dict())
    code.norm.load_state_dict(ours.norm.state_dict())
    f = torch.randn(5, 8)
    torch.testing.assert_close(ours(f), code(f))
    with torch.no_grad():
        ours.fc1.weight.zero_()
        ours.fc1.bias.zero_()
        ours.fc2.bias.zero_()
    torch.testing.assert_close(ours(f), torch.nn.functional.layer_norm(f, (8,), eps=1e-5))


def test_tii_maps_the_argmax_over_seen_classes_to_its_task() -> None:
    tasks = [Task(i, (0, 1), ("a", "b"), 2 * i) for i in range(3)]
    logits = torch.randn(20, 6, generator=torch.Generator().manual_seed(2))
    logits[:, 4:] += 10  # the unseen task's classes would win the argmax unmasked
    want = ref.tii_task(logits, [[0, 1], [2, 3], [4, 5]], 1, 6)
    assert torch.equal(inferred_tasks(logits[:, :4], tasks), want)
    assert set(want.tolist()) == {0, 1}


def test_l_proto_is_the_codes_and_a_hand_value() -> None:
    # M = [e1; e2]: sim = I / 0.8, each row's cross-entropy log(1 + e^-1.25)
    hand = proto_loss(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]]), 0.8)
    assert hand.item() == pytest.approx(math.log(1 + math.exp(-1.25)), rel=1e-6)
    gen = torch.Generator().manual_seed(3)
    centroids, feats = torch.randn(2, 3, 4, generator=gen), torch.randn(5, 4, generator=gen)
    code = ref.orth_loss(feats, {0: list(centroids[0]), 1: list(centroids[1])}, reg=0.5)
    torch.testing.assert_close(0.5 * proto_loss(feats, centroids.flatten(0, 1), 0.8), code)
    torch.testing.assert_close(proto_loss(feats, torch.zeros(0, 4), 0.8), ref.orth_loss(feats, {}, reg=1.0))


def test_l_proto_in_groups_is_the_mean_of_the_codes_per_gpu_losses() -> None:
    """The code's L_proto is each of 8 GPUs' loss on its own 24 images with every centroid, the gradients averaged by
    DDP: the mean of the code's orth_loss over the batch's groups (here 4 groups of 3 of a batch of 12)."""
    gen = torch.Generator().manual_seed(4)
    centroids, feats = torch.randn(2, 3, 4, generator=gen), torch.randn(12, 4, generator=gen)
    cls_mean = {0: list(centroids[0]), 1: list(centroids[1])}
    per_gpu = torch.stack([ref.orth_loss(part, cls_mean, reg=1.0) for part in feats.split(3)]).mean()
    torch.testing.assert_close(grouped_proto_loss(feats, centroids.flatten(0, 1), 0.8, 3), per_gpu)
    whole = ref.orth_loss(feats, cls_mean, reg=1.0)  # one group of 12: another weight on the batch's rows
    assert not torch.allclose(per_gpu, whole)
    torch.testing.assert_close(grouped_proto_loss(feats, centroids.flatten(0, 1), 0.8, 12), whole)


def test_the_lora_update_is_the_codes_per_image_x_a_b_over_r_on_k_and_v() -> None:
    method = built("method.peft=lora", "method.lora_rank=3", started=2)
    wrapper = method.lora.wrappers[0]
    bound = 1 / math.sqrt(3)  # Kaiming-uniform (a = sqrt 5) on the code's (d, r) A
    assert wrapper.a.abs().max() <= bound and wrapper.a.abs().max() > 0.8 * bound
    with torch.no_grad():
        wrapper.bank_a.normal_()
        wrapper.bank_b.normal_()
    chosen, x = torch.tensor([1, 0, 1]), torch.randn(3, 5, wrapper.qkv.in_features)
    wrapper.chosen = chosen
    got = wrapper(x) - wrapper.qkv(x)
    a, b = (
        wrapper.bank_a[chosen].transpose(-1, -2),
        wrapper.bank_b[chosen].transpose(-1, -2),
    )  # (B, 2, d, r), (B, 2, r, w)
    want = ref.lora_qkv_update(x, (a[:, 0], b[:, 0]), (a[:, 1], b[:, 1]), rank=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not got[..., : wrapper.width].any()


# ----------------------------------------------------------------------------- multi-centroid statistics
def clusters(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes of 30 images in 3 blobs each, and one image of class 1 far away (a cluster of one)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[0.0, 0], [8, 0], [0, 8], [30, 30], [38, 30], [30, 38]])
    labels = torch.tensor([0] * 30 + [1] * 31)
    x = centres.repeat_interleave(10, 0) + torch.randn(60, 2, generator=gen)
    return torch.cat([x, torch.tensor([[100.0, -100]])]), labels


def observed_clusters(x: torch.Tensor, labels: torch.Tensor, ranks: int = 1) -> ga.GaussianAligner:
    """A 3-centroid aligner over one task of 2 classes, its rows observed in batches of 7 split over ``ranks``
    (each rank its own rows, then the observations added up as the loop does), and settled."""
    parts = [ga.GaussianAligner(ga.AlignmentConfig(covariance="diagonal", centroids=3), 2) for _ in range(ranks)]
    for part in parts:
        part.add_task(torch.nn.Linear(2, 2))
        part.start(len(x))
    for lo in range(0, len(x), 7):
        rows = torch.arange(lo, min(lo + 7, len(x)))
        for r, part in enumerate(parts):
            own = rows[r::ranks]
            part.observe(x[own], labels[own], own)
    for other in parts[1:]:
        for mine, theirs in zip(parts[0].observations(), other.observations(), strict=True):
            mine.add_(theirs)
    parts[0].settle()
    return parts[0]


def test_multi_centroid_statistics_are_the_codes_kmeans_means_and_variances() -> None:
    x, labels = clusters()
    block = observed_clusters(x, labels).tasks[0]
    for c in range(2):
        means, variances = ref.multi_centroid(x[labels == c].double().numpy(), 3, seed=0)
        torch.testing.assert_close(block.mean[c].double(), torch.stack(means), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            block.factor[c].double().square() - 1e-4, torch.stack(variances), atol=1e-5, rtol=1e-4
        )
        assert block.live[c].tolist() == [bool(v.mean() != 0) for v in variances]
    assert block.live.sum() == 5  # class 1's image far away is a cluster of one: no variance, no samples
    assert torch.equal(observed_clusters(x, labels, ranks=2).tasks[0].mean, block.mean)


def test_the_codes_alignment_step_count_and_clbenchs_seen_classes() -> None:
    """HiDe TAP with 2 old classes and 1 new, 10 centroids, bs 4: 600 samples drawn, 2 steps of 20 (seen: 3)."""
    tasks = [Task(0, (0, 1), ("a", "b"), 0), Task(1, (2,), ("c",), 2)]
    counts = {}
    for steps in ("old", "seen"):
        config = ga.AlignmentConfig(
            covariance="diagonal", centroids=10, samples_per_class=20, batch_size=20, steps=steps
        )
        part = ga.GaussianAligner(config, 3)
        for task in tasks:
            part.add_task(torch.nn.Linear(3, task.num_classes))
            part.tasks[-1].factor.fill_(1.0)
            part.tasks[-1].live.fill_(True)
        counts[steps] = len(part.draw(tasks, 1, 0).y)
    variances = {c: [torch.ones(3)] * 10 for c in range(3)}
    assert ref.sampled_count(variances, 20) == 600
    assert counts["old"] == ref.alignment_steps([[0, 1], [2]], 1) * 20 == 40
    assert counts["seen"] == 3 * 20


# ----------------------------------------------------------------------------- the run
def test_phases_settings_and_costs_of_a_task() -> None:
    method = built(started=1)
    names = [p.name for p in method.phases(method.tasks[1], 3)]
    assert names == ["tii_train", "tii_stats", "tii_align", "train", "tap_stats", "tap_align"]
    assert [p.name for p in method.phases(method.tasks[0], 3)][:2] == ["tii_train", "tii_stats"]
    tii = method.phases(method.tasks[1], 3)[0].trainer
    assert tii["optimizer"] == "adam" and tii["lr"] == pytest.approx(0.0005 * 24 / 256) and tii["grad_clip"] == 1.0
    assert method.forwards_per_test_image() == {"til": 1, "cil": 2}
    entry = method.storage()["bits_per_task"][0]
    assert entry["prompt_slot"] == 32 * 2 * method.config.length * method.backbone.num_features  # one block here
    assert entry["tap_class_means"] == 32 * 10 * method.tasks[0].num_classes * method.backbone.num_features


def test_the_default_lrs_are_stored_after_the_codes_batch_scaling() -> None:
    cfg = tiny_config("method=hide")
    assert cfg.trainer.lr == pytest.approx(0.03 * 24 / 256) and cfg.trainer.lr_scale_batch is None
    assert cfg.method.tii_alignment.lr == pytest.approx(0.005 * 24 / 256) and cfg.method.tap_alignment.lr == 0.005
    assert cfg.method.tii_alignment.steps == cfg.method.tap_alignment.steps == "seen"
    assert tiny_config("method=hide", "method.ca_steps=old_classes").method.tap_alignment.steps == "old"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("method.peft=adapter", "method.peft"),
        ("method.prefix_layout=swap", "method.prefix_layout"),
        ("method.ca_steps=all", "method.ca_steps"),
        ("+method.tap_alignment.steps=old", "method.tap_alignment.steps"),
        ("method.tii_alignment.covariance=full", "method.alignment.covariance"),
        ("method.lora_momentum=2", "method.lora_momentum"),
    ],
)
def test_bad_values_are_refused_before_any_work(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        tiny_config("method=hide", override)


def test_the_other_pefts_keys_are_named_inert() -> None:
    assert "method.lora_rank" in HiDe.unused_keys(tiny_config("method=hide").method)
    assert "method.prefix_layout" in HiDe.unused_keys(tiny_config("method=hide", "method.peft=lora").method)
    assert np.isclose(tiny_config("method=hide").method.proto_temperature, 0.8)


def test_the_table_holds_the_published_numbers_and_its_presets_sweep_as_one() -> None:
    """The CIFAR-100 FAA/CAA beside its preset; SD-LoRA's re-runs (Protocol P's micro metrics) published only; the
    glob runs exactly the rows with a preset."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from clbench import paper_table
    from clbench.config import config_dir

    table = paper_table.load_table("hide")
    given = {r.label: {k: v for k, v in r.published.items() if v is not None} for r in table.rows}
    rows = {r.preset: given[r.label] for r in table.rows if r.preset}
    assert rows["hide_cifar100_10tasks"] == {"faa": (92.61, None), "caa": (94.03, None)}
    rerun = given["HiDe-Prompt, ImageNet-R 10 tasks, SD-LoRA's re-run"]
    assert rerun == {"last_acc": (74.65, None), "avg_acc": (78.46, None)}
    parser = OverridesParser.create(
        config_loader=ConfigLoaderImpl(config_search_path=create_config_search_path(str(config_dir())))
    )
    (override,) = parser.parse_overrides(["experiment=glob(hide_*)"])
    assert sorted(override.sweep_string_iterator()) == sorted(rows)
