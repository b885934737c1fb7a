"""TUNA's rules (PTM spec part 2 §2.7) against an independent transcription of its official code
(tests/oracles/tuna_reference.py, the code's loops): the EMR merge (by hand and as emr_merge computes it), CosFace
(AngularPenaltySMLoss), the orthogonality term (|mean cos|), the universal adapter of each ``universal`` value, entropy
routing and the ensemble (_eval_cnn), the code's mean decay, what a task trains and what stays frozen, the adapter
carried on from the previous task, the state through checkpoints and artifacts, and the test-time cost."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from clbench.data import Task
from clbench.errors import ConfigError
from clbench.loop.optim import build_optimizer
from clbench.loop.resume import finish_untrained
from clbench.loop.runtime import build_runtime
from clbench.loop.step import train_step
from clbench.methods import tuna
from conftest import assert_replays, one_step_into, optimized, tiny_config, train_tasks
from oracles import tuna_reference as ref

# Small alignments: a few samples a class, two epochs.
SMALL = ("method.alignment.samples_per_class=8", "method.alignment.batch_size=8", "method.alignment.epochs=2")


def build(*overrides: str):
    return build_runtime(tiny_config("method=tuna", "method.bottleneck=4", *SMALL, *overrides))


def started(*overrides: str, tasks: int = 3, seed: int = 0):
    """A method with ``tasks`` tasks through their lifecycle without training, every task set's tensors random (so the
    sets differ and the merge has signs to settle), the universal adapter merged from them."""
    method, rt = build(*overrides)
    gen = torch.Generator().manual_seed(seed)
    for task in rt.benchmark.tasks[:tasks]:
        method.before_task(task)
        with torch.no_grad():
            for p in method.sets.parameters(method.task_set(task.id)):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        finish_untrained(method, task)
    return method.eval(), rt


def set_state(method, k: int) -> dict[str, torch.Tensor]:
    return {n: v.clone() for n, v in method.sets.state(".").items() if n.startswith(f".{k}.")}


# ----------------------------------------------------------------------------- the rules on small tensors
def test_emr_merge_by_hand_and_as_the_codes_loops() -> None:
    """§2.7-1. Entries: (1, 2, -1) mean > 0 -> +max positive 2; (-2, 1, 1) mean exactly 0 -> sign -1, -2;
    (0, 0, 0) nobody agrees with -1 -> 0; (0.5, -1, -1) -> -1."""
    a = torch.tensor([[1.0, -2.0], [0.0, 0.5]])
    b = torch.tensor([[2.0, 1.0], [0.0, -1.0]])
    c = torch.tensor([[-1.0, 1.0], [0.0, -1.0]])
    merged = tuna.emr_merge([a, b, c])
    assert merged.tolist() == [[2.0, -2.0], [0.0, -1.0]]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-3, 4, (5, 7), generator=gen).float() for _ in range(4)]  # ties and zeros
    expected = ref.emr_merge([{"w": t} for t in tensors])["w"]
    assert torch.equal(tuna.emr_merge(tensors), expected)


@pytest.mark.parametrize("margin", [0.0, 0.3])
def test_cosface_is_ce_of_scaled_cosines_with_the_margin_off_the_target(margin: float) -> None:
    """§2.7-2: m = 0 is CE(20 cos); m = 0.3 is CE after 20 x 0.3 = 6 off the target's logit; both the code's loss."""
    gen = torch.Generator().manual_seed(1)
    cos = torch.rand(6, 5, generator=gen) * 2 - 1
    y = torch.tensor([0, 4, 2, 2, 1, 3])
    by_hand = F.cross_entropy(20 * cos - 20 * margin * F.one_hot(y, 5), y)
    torch.testing.assert_close(tuna.cosface(cos, y, 20.0, margin), by_hand)
    torch.testing.assert_close(tuna.cosface(cos, y, 20.0, margin), ref.cosface(cos, y, 20.0, margin))
    if margin:
        logits = 20 * cos
        logits[torch.arange(6), y] -= 6
        torch.testing.assert_close(tuna.cosface(cos, y, 20.0, margin), F.cross_entropy(logits, y))


def test_the_orthogonality_term_is_the_abs_of_the_mean_cosine_not_the_mean_of_abs() -> None:
    """§2.7-3: identical up-projections give |mean of the unit rows' Gram|; rows (1, 0) and (-1, 0) give cosines
    +1, -1, -1, +1: mean 0 (the mean of the absolute values would be 1)."""
    gen = torch.Generator().manual_seed(2)
    u = torch.randn(6, 3, generator=gen)
    unit = F.normalize(u, dim=1)
    torch.testing.assert_close(tuna.up_projection_overlap(u, u), (unit @ unit.T).mean().abs())
    mixed = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert tuna.up_projection_overlap(mixed, mixed) == 0


def test_the_methods_orthogonality_term_and_loss_are_the_codes() -> None:
    """At task 2 against tasks 0 and 1 (random up-projections): orth_loss's loops (1/L over the blocks); the training
    loss is CosFace on the task's head + reg e^{-3} orth."""
    method, rt = started(tasks=3)
    task = rt.benchmark.tasks[2]
    up = [[bank.sets[method.task_set(i)].up.weight for bank in method.sets.banks] for i in range(3)]
    torch.testing.assert_close(method.orthogonality(2), ref.orth_loss(up[2], up[:2], len(method.sets.banks)))
    x, y = rt.benchmark.train[2].batch(None, 0, 8)
    method.stage = "train"
    method.sets.select(method.task_set(2))
    loss, logs = method.training_loss(rt.test_tf(x), y, task)
    with torch.no_grad():
        feats = method.adapter_features(rt.test_tf(x), method.task_set(2))
    cos = ref.cosine_logits(feats, [method.heads[2].weight])
    expected = ref.cosface(cos, y - task.offset) + 1e-3 * math.exp(-3) * logs["orth"]
    torch.testing.assert_close(loss, expected)


def test_entropy_routing_takes_the_least_entropy_adapter_ties_to_the_first() -> None:
    """§2.7-5: image 0 is sharper through adapter 1, image 1 equally sharp through both (-> 0), image 2 sharper
    through adapter 0."""
    a0 = torch.tensor([[1.0, 1.0, 1.0], [5.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
    a1 = torch.tensor([[0.0, 8.0, 0.0], [0.0, 5.0, 0.0], [0.0, 1.0, 0.0]])
    routed = tuna.route([a0, a1])
    assert torch.equal(routed, torch.stack([a1[0], a0[1], a0[2]]))


def test_tuna_codes_mean_decay_shrinks_the_newest_classes_most() -> None:
    """§2.7-6: inc 20, t = 9 -> 0.91 (c = 0), 0.90 (c = 5), 0.89 (c = 25), 0.81 (c = 185): the code's decay for every
    class through the method's aligner."""
    method, _ = build("method.alignment.mean_shrink=tuna_code")
    tasks = [Task(t, tuple(range(20 * t, 20 * t + 20)), tuple(map(str, range(20))), 20 * t) for t in range(10)]
    factors = method.aligner.shrink(tasks, 9)
    torch.testing.assert_close(factors[[0, 5, 25, 185]], torch.tensor([0.91, 0.90, 0.89, 0.81], dtype=torch.float64))
    code = torch.tensor([float(ref.decayed_mean(torch.ones(()), c, 180, 200, 9)) for c in range(200)])
    torch.testing.assert_close(factors, code.double())


# ----------------------------------------------------------------------------- the universal adapter and prediction
def test_the_universal_adapter_is_the_emr_merge_of_every_task_set() -> None:
    """§2.7-4: after task 2, set 0 holds emr_merge over the three task sets, tensor by tensor; its features differ
    from the last task adapter's."""
    method, rt = started(tasks=3)
    for i, bank in enumerate(method.sets.banks):
        vectors = [bank.sets[method.task_set(t)].state_dict() for t in range(3)]
        for name, value in ref.emr_merge(vectors).items():
            assert torch.equal(bank.sets[tuna.UNIVERSAL].state_dict()[name], value), (i, name)
    x = rt.test_tf(rt.benchmark.test[0].x[:4])
    assert not torch.allclose(method.adapter_features(x, tuna.UNIVERSAL), method.features(x, 2))


@pytest.mark.parametrize("universal", ["emr", "last"])
def test_cil_is_the_codes_eval_cnn(universal: str) -> None:
    """§2.2: the universal pass through the merged adapter (emr) or, as the code's adapter_id = t + 1 runs, the last
    task's (last: §2.7-4, its features equal A_t's); the sum of the two softmaxes of 20 cos; after task 0 the cosines
    through A_0. TIL: the task's adapter and head."""
    method, rt = started(f"method.universal={universal}", tasks=1)
    x = rt.test_tf(torch.cat([rt.benchmark.test[t].x[:3] for t in range(3)]))
    weights = [method.heads[0].weight]
    torch.testing.assert_close(method.predict(x, None), ref.eval_cnn([method.features(x, 0)], None, weights))
    method, rt = started(f"method.universal={universal}", tasks=3)
    per_adapter = [method.features(x, i) for i in range(3)]
    u = method.adapter_features(x, tuna.UNIVERSAL) if universal == "emr" else method.features(x, 2)
    weights = [head.weight for head in method.heads]
    torch.testing.assert_close(method.predict(x, None), ref.eval_cnn(per_adapter, u, weights))
    torch.testing.assert_close(method.predict(x, 1), ref.cosine_logits(per_adapter[1], [weights[1]]))


@pytest.mark.parametrize(("universal", "cost"), [("emr", lambda t: t + 2), ("last", lambda t: t + 1)])
def test_a_test_image_costs_a_forward_per_task_adapter_and_the_universal_one(universal: str, cost) -> None:
    """CIL after task t >= 1: t + 1 task adapters and the universal adapter (last: A_t's features reused); 1 after
    task 0; TIL always 1 (tests/test_test_time_cost.py counts the passes of the default)."""
    method, rt = build(f"method.universal={universal}")
    for task in rt.benchmark.tasks:
        method.before_task(task)
        expected = 1 if task.id == 0 else cost(task.id)
        assert method.forwards_per_test_image() == {"til": 1, "cil": expected}


# ----------------------------------------------------------------------------- what a task trains
@pytest.mark.parametrize("freeze", [True, False])
def test_stored_sets_stay_frozen_or_take_the_orthogonality_gradient_as_the_code(freeze: bool) -> None:
    """§2.7-7: task 1's set starts as task 0's (cur_adapter carried on); the optimizer holds it and the task's head
    (and, with freeze_old_adapters=false, the stored set's up-projections: the code's optimizer holds every adapter
    tensor, and only those get a gradient); after task 1 task 0's set is bit-identical (true) or only its
    up-projection moved (false)."""
    method, rt = build(f"method.freeze_old_adapters={str(freeze).lower()}", "trainer.epochs=1")
    train_tasks(method, rt, 1)
    task1 = rt.benchmark.tasks[1]
    method.before_task(task1)
    assert all(torch.equal(a, b) for a, b in zip(method.sets.parameters(1), method.sets.parameters(2), strict=True))
    before = set_state(method, 1)
    phase = method.phases(task1, 1)[0]
    method.before_phase(task1, phase)
    optimizer = build_optimizer(method, task1, phase, rt.cfg.trainer)
    held = {id(p) for p in optimized(optimizer)}
    stored_up = {id(bank.sets[1].up.weight) for bank in method.sets.banks}
    own = {id(p) for p in [*method.sets.parameters(2), method.heads[1].weight]}
    assert held == own | (set() if freeze else stored_up)
    for _ in range(3):
        x, y = rt.benchmark.train[1].batch(None, 0, 16)
        train_step(method, task1, rt, x, y, optimizer=optimizer, params=optimized(optimizer))
    after = set_state(method, 1)
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved == (set() if freeze else {n for n in before if n.endswith("up.weight")})


@pytest.mark.parametrize("decay", [False, True])
def test_earlier_heads_stay_or_shrink_under_weight_decay_as_the_code_holds_them(decay: bool) -> None:
    """The code's optimizer holds every head and its loss takes every head's cosines (L145-146, L188-190): task 0's
    head gets a zero gradient in task 1, so torch's SGD (momentum buffer 0 at the first step) moves it by
    -lr * wd * w, along itself: w (1 - lr wd). Without the option it is not in the optimizer and stays bit-identical;
    the task's own logits are the same either way (the slice of the whole head's cosines)."""
    method, rt = build(f"method.decay_old_heads={str(decay).lower()}", "trainer.epochs=1", "trainer.weight_decay=0.01")
    train_tasks(method, rt, 1)
    task1 = rt.benchmark.tasks[1]
    method.before_task(task1)
    phase = method.phases(task1, 1)[0]
    method.before_phase(task1, phase)
    optimizer = build_optimizer(method, task1, phase, rt.cfg.trainer)
    old = method.heads[0].weight
    (group,) = [g for g in optimizer.param_groups if any(p is method.heads[1].weight for p in g["params"])]
    assert any(p is old for p in optimized(optimizer)) == decay
    lr, before = float(group["lr"]), old.detach().clone()
    assert lr > 0 and group["weight_decay"] > 0
    x, y = rt.benchmark.train[1].batch(None, 0, 16)
    train_step(method, task1, rt, x, y, optimizer=optimizer, params=optimized(optimizer))
    expected = before * (1 - lr * group["weight_decay"]) if decay else before
    torch.testing.assert_close(old.detach(), expected, rtol=1e-6, atol=1e-7)


def test_adapter_init_fresh_starts_each_task_at_the_pretrained_vit() -> None:
    method, rt = build("method.adapter_init=fresh", "trainer.epochs=1")
    train_tasks(method, rt, 1)
    method.before_task(rt.benchmark.tasks[1])
    assert all(bank.sets[2].up.weight.abs().sum() == 0 for bank in method.sets.banks)
    assert any(bank.sets[1].up.weight.abs().sum() > 0 for bank in method.sets.banks)


def test_the_alignment_trains_every_head_on_20_cos_of_the_drawn_features() -> None:
    """From task 1: the align phase's optimizer holds every head (nothing else); its loss is CE of 20 cos over the
    seen classes (classifer_align L328-331)."""
    method, rt = started(tasks=2)
    task = rt.benchmark.tasks[1]
    align = method.phases(task, 1)[-1]
    assert align.name == "align" and align.data == "features" and align.trainer["cosine_epochs"] is None
    method.before_phase(task, align)
    optimizer = build_optimizer(method, task, align, rt.cfg.trainer)
    assert {id(p) for p in optimized(optimizer)} == {id(h.weight) for h in method.heads}
    drawn = method.drawn_split(task, align, 0)
    loss, _ = method.training_loss(drawn.x, drawn.y, task)
    weights = [h.weight for h in method.heads]
    torch.testing.assert_close(loss, F.cross_entropy(20 * ref.cosine_logits(drawn.x, weights), drawn.y))


# ----------------------------------------------------------------------------- state
def test_a_checkpoint_replay_restores_every_set_and_gaussian_mid_task_too() -> None:
    """After two tasks and one step into the third: a fresh method walked to the same position by the loop's replay
    takes the state_dict back exactly (task sets, universal adapter, heads, class Gaussians), and predicts the
    same."""
    method, rt = build("trainer.epochs=1")
    one_step_into(method, rt, 2)
    state = method.state_dict()
    assert any(".sets.3." in k for k in state) and any(k.startswith("aligner.tasks.1.") for k in state)
    assert_replays(method, build("seed=5", "trainer.epochs=1")[0], rt, 2)


def test_the_artifacts_storage_and_recorded_options() -> None:
    """Artifacts: the heads and every set (the universal one included); storage per task: the set (2dr + r + d a
    block), the bias-free head, the class means and covariance factors; the universal adapter shared; results.json
    names the four options."""
    method, rt = started(tasks=2)
    saved = method.artifacts()
    assert {k.split(".")[0] for k in saved} == {"head", "adapters"}
    assert {k.split(".")[1] for k in saved if k.startswith("adapters.")} == {"0", "1", "2"}
    storage = method.storage()
    adapter, d = 2 * 32 * 4 + 4 + 32, 32  # TINY: one block, d 32, r 4
    for task, entry in zip(rt.benchmark.tasks[:2], storage["bits_per_task"], strict=True):
        c = task.num_classes
        assert entry == {"adapter": 32 * adapter, "head": 32 * c * d, "class_means": 32 * c * d,
                         "class_covariances": 32 * c * d * d}  # fmt: skip
    assert storage["shared_bits"] == {"universal_adapter": 32 * adapter}
    assert storage["trainable_params"] == adapter + rt.benchmark.tasks[1].num_classes * d
    assert method.extra_results()["tuna"] == {"universal": "emr", "freeze_old_adapters": True, "decay_old_heads": False,
                                              "mean_shrink": "none",
                                              "ca_tmax": "epochs", "adapter_init": "continue",
                                              "path": "described method"}  # fmt: skip
    code = (
        "method.universal=last",
        "method.freeze_old_adapters=false",
        "method.decay_old_heads=true",
        "method.alignment.cosine_epochs=5",
    )
    assert build(*code)[0].extra_results()["tuna"]["path"] == "official code"


@pytest.mark.parametrize(
    ("override", "key"),
    [("method.universal=merged", "method.universal"), ("method.margin=-0.1", "method.margin"),
     ("method.adapter_init=zero", "method.adapter_init"), ("method.scale=0", "method.scale")],
)  # fmt: skip
def test_bad_values_are_refused_before_any_work(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        tiny_config("method=tuna", override)
