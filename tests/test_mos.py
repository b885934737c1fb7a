"""MOS's rules (PTM spec part 2 §1.7) against an independent transcription of its official code
(tests/oracles/mos_reference.py) or first principles: the merge map after a step (ema_step) and inside every forward
(official: the stored set drifts 0.9^L a forward, the prefix sums keep the snapshots), the prefix-sum mean, the
self-refinement (by hand, and as the code's per-image loop computes it), the ensemble, L_proto by hand, a fresh set as
the bare ViT; what each task trains, how a set starts (continued or fresh), the official mode's statistics on a
drifting ``cur_adapter``; the alignment's draw; its state through artifacts; results.json's record of the modes."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from clbench.checkpoint import Cursor, Position
from clbench.evaluation import SCENARIOS, scenario_logits
from clbench.loop import train
from clbench.loop.resume import replay
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.base import Phase
from clbench.methods.mos import MOS
from conftest import tiny_config, train_tasks
from oracles import mos_reference as ref

STATS = Phase("statistics", 1, observe=True)
TRAIN = Phase("train", 1)


def build(*overrides: str) -> tuple[MOS, object]:
    return build_runtime(tiny_config("method=mos", "method.bottleneck=4", *overrides))


def code_adapters(method: MOS, k: int) -> list[dict[str, torch.Tensor]]:
    """Set ``k`` as the code's ``adapter_list[k]``: one dict of the four tensors per block (copies)."""
    return [{n: v.detach().clone() for n, v in bank.sets[k].state_dict().items()} for bank in method.sets.banks]


@torch.no_grad()
def randomise(method: MOS, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in method.sets.parameters(k):
        p.copy_(torch.randn(p.shape, generator=gen))


def walk(method: MOS, tasks, seed: int = 0) -> None:
    """Take ``tasks`` through the lifecycle without data: each task's set random, then the statistics phase (the
    snapshot and its prefix sum) and ``after_task``."""
    for task in tasks:
        method.before_task(task)
        randomise(method, task.id, seed + task.id)
        method.before_phase(task, STATS)
        method.after_task(task)


def distance(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    return math.sqrt(sum((x[n] - y[n]).square().sum().item() for x, y in zip(a, b, strict=True) for n in ref.NAMES))


def test_ema_step_pulls_the_trained_set_once_toward_the_mean_of_the_snapshots() -> None:
    """§1.7.1: snapshots A0, A1 and the current A: one step leaves 0.9 A + 0.1 (A0 + A1) / 2 in all four tensors of
    every block (reweight_adapter with idx 2); nothing else moves, and predicting moves nothing."""
    method, rt = build()
    tasks = rt.benchmark.tasks
    walk(method, tasks[:2])
    method.before_task(tasks[2])
    randomise(method, 2, seed=7)
    method.before_phase(tasks[2], TRAIN)
    before = [code_adapters(method, k) for k in range(3)]
    method.after_step(tasks[2])
    for block, bank in enumerate(method.sets.banks):
        sums: list[dict[str, torch.Tensor]] = []
        for k in range(2):
            ref.sum_adapter_param(sums, before[k][block])
        want = ref.reweight_adapter(before[2][block], sums, 2, 0.1)
        got = bank.sets[2].state_dict()
        a, a0, a1 = before[2][block], before[0][block], before[1][block]
        for n in ref.NAMES:
            torch.testing.assert_close(got[n], 0.9 * a[n] + 0.1 * (a0[n] + a1[n]) / 2)
            torch.testing.assert_close(got[n], want[n])
    for k in range(2):
        assert all(
            torch.equal(x[n], y[n]) for x, y in zip(code_adapters(method, k), before[k], strict=True) for n in ref.NAMES
        )
    method.eval()
    method.predict(rt.test_tf(rt.benchmark.test[0].x[:4]), None)
    assert distance(code_adapters(method, 1), before[1]) == 0.0


@pytest.mark.parametrize("depth", [2, 3])
def test_official_mode_pulls_a_stored_set_at_every_block_of_every_evaluated_forward(depth: int) -> None:
    """§1.7.2 (check:mos-inplace): one evaluation forward through set 1 multiplies ||A1 - A0|| by 0.9^L, two by
    0.9^(2L); set 0 and the prefix sum (still the task-0 snapshot) do not move."""
    method, rt = build("method.merge_mode=official", f"backbone.kwargs.depth={depth}")
    tasks = rt.benchmark.tasks
    walk(method, tasks[:2])
    method.eval()
    a0, a1 = code_adapters(method, 0), code_adapters(method, 1)
    x = rt.test_tf(rt.benchmark.test[1].x[:3])
    method.predict(x, 1)
    assert distance(code_adapters(method, 1), a0) == pytest.approx(0.9**depth * distance(a1, a0), rel=1e-5)
    method.predict(x, 1)
    assert distance(code_adapters(method, 1), a0) == pytest.approx(0.9 ** (2 * depth) * distance(a1, a0), rel=1e-5)
    assert distance(code_adapters(method, 0), a0) == 0.0
    first_sum = [b.clone() for b in method.sums.sums[0].buffers()]
    torch.testing.assert_close(first_sum, [p.detach() for p in method.sets.parameters(0)])


def test_official_mode_pulls_in_the_training_forward_and_after_the_step() -> None:
    """Training task 1 in official mode: a forward pulls set 1 L times (reweight_adapter before each block), the step's
    adapter_merge once more: 0.9^(L + 1) of its distance to A0 (no gradient step: lr 0)."""
    method, rt = build("method.merge_mode=official", "backbone.kwargs.depth=2")
    tasks = rt.benchmark.tasks
    walk(method, tasks[:1])
    method.before_task(tasks[1])
    randomise(method, 1, seed=5)
    method.before_phase(tasks[1], TRAIN)
    a0, a1 = code_adapters(method, 0), code_adapters(method, 1)
    x, y = rt.benchmark.train[1].x[:4], rt.benchmark.train[1].y[:4]
    method.training_loss(rt.test_tf(x), y, tasks[1])
    assert distance(code_adapters(method, 1), a0) == pytest.approx(0.81 * distance(a1, a0), rel=1e-5)
    method.after_step(tasks[1])
    assert distance(code_adapters(method, 1), a0) == pytest.approx(0.9**3 * distance(a1, a0), rel=1e-5)


def test_official_mode_differentiates_each_block_at_the_weights_it_used() -> None:
    """The code assigns each pulled adapter's ``.data`` a new tensor, so block l's backward reads the weights block l
    ran with (pulled l + 1 times), not those left after the forward's last pull: the gradient equals that of a forward
    through those weights held still (no dropout, so the two forwards match)."""
    method, rt = build("method.merge_mode=official", "backbone.kwargs.depth=2", "method.adapter_dropout=0")
    tasks = rt.benchmark.tasks
    walk(method, tasks[:1])
    method.before_task(tasks[1])
    randomise(method, 1, seed=5)
    method.before_phase(tasks[1], TRAIN)
    method.param_groups(tasks[1], TRAIN)  # set 1 and its head train
    still = copy.deepcopy(method)
    x, y = rt.test_tf(rt.benchmark.train[1].x[:4]), rt.benchmark.train[1].y[:4]
    method.training_loss(x, y, tasks[1])[0].backward()
    target = dict(zip(map(id, still.sets.parameters(1)), still.target(1), strict=True))
    with torch.no_grad():
        for block, bank in enumerate(still.sets.banks):
            for p in bank.sets[1].parameters():
                for _ in range(block + 1):
                    p.mul_(1 - still.config.adapter_momentum).add_(target[id(p)], alpha=still.config.adapter_momentum)
    still.config = dataclasses.replace(still.config, adapter_momentum=0.0)  # its forward pulls nothing
    still.training_loss(x, y, tasks[1])[0].backward()
    for mine, held in zip(method.sets.parameters(1), still.sets.parameters(1), strict=True):
        assert mine.grad is not None and mine.grad.any()
        torch.testing.assert_close(mine.grad, held.grad)


def test_official_mode_runs_without_cuda_graphs_and_says_why() -> None:
    official, _ = build("method.merge_mode=official")
    default, _ = build()
    assert "merge_mode=official" in MOS.graph_blocker(official.config)
    assert MOS.graph_blocker(default.config) is None


def test_official_statistics_run_through_a_drifting_copy_that_the_next_task_continues_from() -> None:
    """Official mode, task 1's statistics pass: ``cur_adapter`` (set 2, a copy of set 1) is pulled toward S_0 / 1 = A0
    at every block of every batch, while the snapshot set 1 stays; task 2 starts from the drifted copy."""
    method, rt = build("method.merge_mode=official", "backbone.kwargs.depth=1")
    tasks = rt.benchmark.tasks
    walk(method, tasks[:1])
    method.before_task(tasks[1])
    randomise(method, 1, seed=3)
    a0, a1 = code_adapters(method, 0), code_adapters(method, 1)
    method.before_phase(tasks[1], STATS)
    assert len(method.sets) == 3 and method.sets.running == 2
    method.eval()
    x, y = rt.test_tf(rt.benchmark.train[1].x[:4]), rt.benchmark.train[1].y[:4]
    method.observe(x, y, tasks[1], torch.arange(4))
    method.observe(x, y, tasks[1], torch.arange(4))
    assert distance(code_adapters(method, 2), a0) == pytest.approx(0.81 * distance(a1, a0), rel=1e-5)
    assert distance(code_adapters(method, 1), a1) == 0.0
    method.after_task(tasks[1])
    drifted = code_adapters(method, 2)
    method.before_task(tasks[2])
    assert distance(code_adapters(method, 2), drifted) == 0.0


def test_the_prefix_sum_mean_of_three_snapshots_is_their_mean() -> None:
    """§1.7.3: S_2 / 3 = (A0 + A1 + A2) / 3, tensor by tensor."""
    method, rt = build()
    walk(method, rt.benchmark.tasks)
    sets = [method.sets.parameters(k) for k in range(3)]
    for got, *each in zip(method.sums.mean(3), *sets, strict=True):
        torch.testing.assert_close(got, (each[0] + each[1] + each[2]) / 3)


def hand_heads(method: MOS, weight: torch.Tensor) -> None:
    """Write a (classes, d) weight with zero biases into the per-task heads."""
    with torch.no_grad():
        for task in method.tasks[: method.num_seen]:
            method.heads[task.id].weight.copy_(weight[task.offset : task.offset + task.num_classes])
            method.heads[task.id].bias.zero_()


def full_head(method: MOS) -> torch.nn.Linear:
    """The per-task heads as the code's single head (for the reference)."""
    head = torch.nn.Linear(method.backbone.num_features, sum(h.out_features for h in method.heads))
    with torch.no_grad():
        head.weight.copy_(torch.cat([h.weight for h in method.heads]))
        head.bias.copy_(torch.cat([h.bias for h in method.heads]))
    return head


def test_self_refinement_follows_the_head_and_stops_at_a_fixed_point_or_the_fourth_evaluation() -> None:
    """§1.7.4, three tasks of two classes, F_j = e_j: image 0 starts at task 0, the head on F_0 predicts class 4
    (task 2), on F_2 class 5 (task 2): stop, output head(F_2). Image 1 cycles 0 -> 1 -> 0 -> 1: the 4th evaluation
    (on F_1) is the output. Both in one batch, and as the code's per-image loop."""
    method, rt = build()
    walk(method, rt.benchmark.tasks)
    d = method.backbone.num_features
    e = torch.eye(d)
    w = torch.zeros(6, d)
    w[4, 0], w[5, 2], w[4, 2] = 1.0, 1.0, 0.5  # image 0: F_0 -> class 4, F_2 -> class 5
    w[2, 3], w[0, 4] = 1.0, 1.0  # image 1: F_0 (e3) -> class 2 (task 1), F_1 (e4) -> class 0 (task 0)
    hand_heads(method, w)
    branches = torch.stack([torch.stack([e[0], e[1], e[2]]), torch.stack([e[3], e[4], e[5]])])
    out = method.refine(branches, torch.tensor([0, 0]))
    torch.testing.assert_close(out[0], w @ e[2])
    torch.testing.assert_close(out[1], w @ e[4])
    cls2task = {c: c // 2 for c in range(6)}
    orig = torch.tensor([[1.0, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])  # both start at task 0
    torch.testing.assert_close(out, ref.eval_cnn(orig, branches, full_head(method), cls2task, 2, ensemble=False))


def test_the_ensemble_adds_the_refined_softmax_to_the_prototype_softmax_at_t_plus_one() -> None:
    """§1.7.5: score = softmax(l) + softmax((t + 1) z_0) at t = 2, z_0 the cosines to the prototypes; by hand for one
    image and as the code computes it for random ones."""
    method, rt = build()
    walk(method, rt.benchmark.tasks)
    d = method.backbone.num_features
    gen = torch.Generator().manual_seed(1)
    hand_heads(method, torch.randn(6, d, generator=gen))
    with torch.no_grad():
        for task in method.tasks:
            method.prototypes[task.id].weight.copy_(torch.randn(task.num_classes, d, generator=gen))
    branches = torch.randn(5, 3, d, generator=gen)
    got = method.cil_scores(branches[:, 0], branches, branches[:, 0])
    z0 = F.normalize(branches[:, 0], dim=1) @ F.normalize(torch.cat([p.weight for p in method.prototypes]), dim=1).T
    want = ref.eval_cnn(z0, branches, full_head(method), {c: c // 2 for c in range(6)}, 2)
    torch.testing.assert_close(got, want)
    z, refined = z0[0].tolist(), method.refine(branches[:1], torch.tensor([int(z0[0].argmax()) // 2]))[0].tolist()
    hand = [
        math.exp(a) / sum(map(math.exp, refined)) + math.exp(3 * b) / sum(math.exp(3 * c) for c in z)
        for a, b in zip(refined, z, strict=True)
    ]
    torch.testing.assert_close(got[0], torch.tensor(hand), rtol=1e-5, atol=1e-6)


def test_l_proto_on_two_means_and_two_features_is_the_hand_computation() -> None:
    """§1.7.6: K = 2 means, B = 2 features in 2-d: rows m1 = (1, 0), m2 = (0, 1), f1 = (1, 1), f2 = (2, 0); L_proto =
    the mean over rows of -log softmax(row . rows / 0.8)[own]; x 0.1; equal to orth_loss."""
    method, rt = build()
    tasks = rt.benchmark.tasks
    walk(method, tasks[:1])
    method.before_task(tasks[1])
    d = method.backbone.num_features
    means = torch.zeros(2, d)
    means[0, 0], means[1, 1] = 1.0, 1.0
    feats = torch.zeros(2, d)
    feats[0, :2], feats[1, 0] = 1.0, 2.0
    with torch.no_grad():
        method.aligner.tasks[0].mean.copy_(means)
    rows = [(1, 0), (0, 1), (1, 1), (2, 0)]
    hand = 0.0
    for i, r in enumerate(rows):
        sims = [(r[0] * s[0] + r[1] * s[1]) / 0.8 for s in rows]
        hand += -(sims[i] - math.log(sum(math.exp(v) for v in sims))) / 4
    got = 0.1 * method.proto_loss(feats, tasks[1])
    assert got.item() == pytest.approx(0.1 * hand, rel=1e-6)
    assert got.item() == pytest.approx(ref.orth_loss(list(means), feats, 0.1).item(), rel=1e-6)


def test_a_fresh_set_is_the_bare_vit_and_a_continued_set_starts_as_the_previous_ended() -> None:
    """§1.7.8: a fresh set (W_up = 0) gives the pretrained ViT's features; ``continue`` starts task 1's set as task 0's
    ended, ``fresh`` with W_up = 0 again."""
    method, rt = build()
    tasks = rt.benchmark.tasks
    method.before_task(tasks[0])
    method.eval()
    x = rt.test_tf(rt.benchmark.test[0].x[:4])
    torch.testing.assert_close(method.branch_features(x, 0), method.branch_features(x, None))
    randomise(method, 0, seed=2)
    method.before_phase(tasks[0], STATS)
    method.after_task(tasks[0])
    method.before_task(tasks[1])
    assert distance(code_adapters(method, 1), code_adapters(method, 0)) == 0.0
    fresh, rt = build("method.adapter_init=fresh")
    walk(fresh, rt.benchmark.tasks[:1])
    fresh.before_task(rt.benchmark.tasks[1])
    assert all(not a["up.weight"].any() for a in code_adapters(fresh, 1))


def test_training_groups_and_the_alignments_draw() -> None:
    """Task t trains set t at the lr and head t at 0.1 x (every parameter decayed); the alignment draws 5 x batch
    samples of every seen class (3 classes seen at batch 4: 60 samples, 3 steps of 20, spec §6.1 oracle 3)."""
    method, rt = build(
        "data.num_tasks=3",
        "method.alignment.samples_per_class=20",
        "method.alignment.batch_size=20",
    )
    tasks = rt.benchmark.tasks
    walk(method, tasks[:1])
    method.before_task(tasks[1])
    adapter, head = method.param_groups(tasks[1], TRAIN)
    assert [id(p) for p in adapter["params"]] == [id(p) for p in method.sets.parameters(1)]
    assert [id(p) for p in head["params"]] == [id(p) for p in method.heads[1].parameters()]
    assert head["lr_factor"] == 0.1 and "lr_factor" not in adapter and method.no_weight_decay_ids() == set()
    method.before_phase(tasks[1], STATS)
    method.after_task(tasks[1])
    drawn = method.aligner.draw(tasks, 1, epoch=0)
    assert drawn.x.shape == (4 * 20, method.backbone.num_features)
    assert method.aligner.phases(tasks[1])[0].trainer["batch_size"] == 20


@pytest.mark.parametrize("mode", ["ema_step", "official"])
def test_a_trained_runs_artifacts_predict_as_it_does(mode: str) -> None:
    """Heads, adapter sets, prefix sums and prototypes from the artifacts give a fresh method the same predictions."""
    overrides = (f"method.merge_mode={mode}", "trainer.epochs=1", "method.alignment.epochs=1")
    method, rt = build(*overrides, "method.alignment.samples_per_class=8", "method.alignment.batch_size=8")
    train_tasks(method, rt, 2)
    method.eval()
    saved = method.artifacts()
    x = rt.test_tf(torch.cat([split.x[:4] for split in rt.benchmark.test]))
    fresh, _ = build(*overrides)
    fresh.load_artifacts(saved)
    fresh.eval()
    want = method.predict_scenarios(x, 1, SCENARIOS)
    got = fresh.predict_scenarios(x, 1, SCENARIOS)
    for s in SCENARIOS:
        torch.testing.assert_close(got[s], want[s])


def test_results_record_the_modes_and_name_official_mode_as_batch_level(tmp_path) -> None:
    """results.json records the three modes and, with ``official``, names ``method.merge_mode`` as batch-level; its
    predictions depend on what was evaluated before (next test)."""
    cfg = tiny_config("method=mos", "method.merge_mode=official", "data.num_tasks=2", "trainer.epochs=1",
                      "method.alignment.epochs=1", "method.alignment.samples_per_class=8",
                      "method.alignment.batch_size=8")  # fmt: skip
    train(cfg, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["evaluation"] == {"per_sample": False, "batch_level": ["method.merge_mode"]}
    assert results["mos"] == {
        "merge_mode": "official", "adapter_init": "continue", "proto_branch": "adapter0"
    }  # fmt: skip


def test_official_predictions_depend_on_the_evaluations_before_them() -> None:
    """Official mode: the same batch evaluated twice gives other logits (its stored set drifted in between), which is
    why it is declared batch-level; the default passes tests/test_honest_evaluation.py."""
    method, rt = build("method.merge_mode=official", "trainer.epochs=1", "method.alignment.epochs=0")
    train_tasks(method, rt, 2)
    method.eval()
    x = rt.test_tf(rt.benchmark.test[1].x[:4])
    first = scenario_logits(method, x, 1, SCENARIOS, "seen")["til"]
    again = scenario_logits(method, x, 1, SCENARIOS, "seen")["til"]
    assert not torch.allclose(first, again)


def test_a_checkpoint_in_the_alignment_brings_back_every_tensor_and_the_predictions() -> None:
    """A resume's replay to task 1's alignment (official mode: ``cur_adapter`` carried as set 2), then the checkpoint's
    tensors: the same state, and after ``after_task`` the same prototypes and predictions (the replay's empty
    statistics are settled before the checkpoint's values replace them, never after)."""
    overrides = ("method.merge_mode=official", "method.alignment.epochs=1", "method.alignment.samples_per_class=8")
    method, rt = build(*overrides, "method.alignment.batch_size=8")
    tasks = rt.benchmark.tasks
    for task in tasks[:2]:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        if task.id == 0:
            method.after_task(task)
    state = method.state_dict()
    fresh, _ = build(*overrides, "method.alignment.batch_size=8", "seed=5")
    replay(fresh, tasks, Position(task=1, step=0, cursor=Cursor(phase=2)), epochs=1)
    fresh.load_state_dict(state)
    for m in (method, fresh):
        m.after_task(tasks[1])
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, method.state_dict()[key]), key
    probe = rt.test_tf(torch.cat([split.x[:4] for split in rt.benchmark.test]))
    assert torch.equal(fresh.eval().predict(probe, None), method.eval().predict(probe, None))
