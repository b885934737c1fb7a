"""The seed tables' rows as their official codes compute them, where the presets of L2P's and MEAT's Table 1 name
those codes: each rule against an independent transcription of the code (tests/oracles/official_rules_reference.py)
on small tensors, with the settings read from the preset itself (so a preset that drops the official rule fails)."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import build_runtime
from clbench.methods.base import Phase, Replay
from conftest import compose_config, tiny_config
from oracles import official_rules_reference as ref

TRAIN = Phase("train", 1)
SGD = ("trainer.optimizer=sgd", "trainer.momentum=0.0", "trainer.weight_decay=0.0", "trainer.grad_clip=null")


def preset_keys(preset: str, *keys: str) -> tuple[str, ...]:
    """``key=value`` overrides of ``keys`` as the paper preset composes them (a key the preset's config does not have
    is left to the default)."""
    cfg = compose_config(f"experiment={preset}")
    absent = object()
    values = {key: OmegaConf.select(cfg, key, default=absent) for key in keys}
    return tuple(f"{key}={'null' if v is None else v}" for key, v in values.items() if v is not absent)


# ------------------------------------------------------------------------------------------------------ ER and DER++
@pytest.mark.parametrize("method", ["er", "derpp"])
def test_er_and_derpp_under_the_l2p_presets_train_every_seen_head_as_the_l2p_code_does(method: str) -> None:
    """L2P Table 1's ER and DER++ rows (loss_scope from the preset): one head over the seen classes, the current rows
    masked to their task, the replayed rows over every seen class; after one SGD step at task 1 the backbone and BOTH
    heads are where the L2P code's step puts them (task 0's head moves: the replayed rows train it)."""
    lr = 0.5
    overrides = (f"method={method}", *preset_keys(f"l2p_table1_{method}_10", "method.loss_scope"), *SGD)
    m, rt = build_runtime(tiny_config(*overrides, f"trainer.lr={lr}"))
    t0, t1 = rt.benchmark.tasks[:2]
    m.before_task(t0)
    m.before_task(t1)
    torch.manual_seed(3)
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([2, 3, 3])
    x1, y1 = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 3, 2])
    x2, y2 = torch.randn(4, 3, 16, 16), torch.tensor([1, 0, 2, 2])
    z1, w1 = torch.randn(4, 4), torch.tensor([2, 4, 4, 2])
    replay = (Replay(x1, y1),) if method == "er" else (Replay(x1, y1, z1, w1), Replay(x2, y2, z1, w1))

    # the L2P code's step: one head (W, b) over the 4 seen classes, plain SGD on every tensor
    backbone = copy.deepcopy(m.backbone)
    W = torch.cat([m.heads[0].weight, m.heads[1].weight]).detach().clone().requires_grad_(True)
    b = torch.cat([m.heads[0].bias, m.heads[1].bias]).detach().clone().requires_grad_(True)
    logits = lambda images: backbone.forward_head(backbone.forward_features(images), pre_logits=True) @ W.T + b  # noqa: E731
    task = (t1.offset, t1.offset + t1.num_classes)
    if method == "er":
        loss = ref.l2p_code_loss(logits(torch.cat([x, x1])), torch.cat([y, y1]), len(y), task)
    else:
        alpha, beta = m.config.alpha, m.config.beta
        loss = (
            ref.l2p_code_loss(logits(x), y, len(y), task)
            + alpha * ref.per_row_mse(logits(x1), z1, w1)
            + beta * torch.nn.functional.cross_entropy(logits(x2), y2)
        )
    params = [*backbone.parameters(), W, b]
    *expected_backbone, W_new, b_new = ref.sgd_step(params, loss, lr)

    optimizer = build_optimizer(m, t1, TRAIN, rt.cfg.trainer)
    got_loss, _ = m.training_loss(x, y, t1, replay=replay)
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
    got_loss.backward()
    optimizer.step()
    torch.testing.assert_close(torch.cat([m.heads[0].weight, m.heads[1].weight]), W_new, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([m.heads[0].bias, m.heads[1].bias]), b_new, rtol=1e-5, atol=1e-6)
    for got, want in zip(m.backbone.parameters(), expected_backbone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------- LwF
class CapturedError(Exception):
    """Stops a run once the step under test has been looked at."""


def test_lwf_under_meat_mixing_distils_towards_the_teacher_on_the_students_own_mixed_input(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MEAT Table 1's LwF row mixes (mixup/cutmix from the preset): with the teacher the preset selects, the first step
    of task 1's training phase (after the warm-up moved the new head alone) distils towards the model as it was on the
    very input the student sees, so the distillation's gradient is zero (the reference codes' on-the-fly teacher: KD's
    gradient (softmax(z/T) - softmax(z_old/T)) / T vanishes at z = z_old; to rounding, since the backward of
    log-softmax recomputes the softmax its own way). A teacher recorded on the clean images pulls the mixed student
    (the previous preset: ~1e-2)."""
    from clbench.loop import train
    from clbench.methods.lwf import LwF

    keys = preset_keys("meat_table1_lwf", "method.teacher", "method.loss_scope", "trainer.mixup", "trainer.cutmix")
    seen: dict[str, object] = {}
    real = LwF.training_loss

    def spy(self: LwF, x: torch.Tensor, y: torch.Tensor, task, ids=None):
        if task.id == 1 and self.stage == "train":
            params = [p for p in self.parameters() if p.requires_grad]
            lam = self.config.lam
            total, _ = real(self, x, y, task, ids)
            self.config.lam = 0.0
            without, _ = real(self, x, y, task, ids)
            self.config.lam = lam
            both = zip(torch.autograd.grad(total, params), torch.autograd.grad(without, params), strict=True)
            kd_grad = [a - b for a, b in both]
            seen["mixed"] = y.is_floating_point()
            seen["kd_grad"] = max(float(g.abs().max()) for g in kd_grad)
            raise CapturedError
        return real(self, x, y, task, ids)

    monkeypatch.setattr(LwF, "training_loss", spy)
    with pytest.raises(CapturedError):
        train(tiny_config("method=lwf", *keys, "method.lam=1.0"), tmp_path)
    assert seen["mixed"], "the step under test was not mixed"
    assert seen["kd_grad"] < 1e-6, f"the distillation pulls the student at its first step: {seen['kd_grad']}"


# ------------------------------------------------------------------------------------------------------------- BiC
def test_bic_validates_on_old_class_counts_and_herds_every_class_again_with_the_new_model(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2P Table 1's BiC row (its memory and teacher settings from the preset) on a fixed total of K = 50 images, 3
    tasks of 2 classes: the bias stage of task t takes floor(0.1 K / n_old) images of every seen class (task 1: 2 each,
    task 2: 1 each); after each task every class keeps ceil(K / n) - ceil(0.1 K / n) exemplars (n = 2: 22, n = 4: 11),
    the new classes' chosen by herding among their images, the old classes' by herding on the NEW model's features
    among their current exemplars, in herding's order (imagenet_main.py L439-535)."""
    from clbench.loop import task as task_module
    from clbench.loop import train

    total = 50
    keys = preset_keys("l2p_table1_bic_10", "memory.reselect", "method.teacher")
    overrides = ("method=bic", "memory.per_class=null", f"memory.size={total}", *keys)
    cfg = tiny_config(*overrides, "method.bias_epochs=1", "trainer.epochs=1", "trainer.eval_random_init=false")
    validation: dict[int, list[int]] = {}
    expected: dict[int, dict[int, list[int]]] = {}
    kept: dict[int, dict[int, list[int]]] = {}
    real_data, real_update = task_module.phase_data, task_module.update_memory

    def phase_data(method, phase, split, streamed_from=None):
        data = real_data(method, phase, split, streamed_from)
        if phase.name == "bias":
            validation[method.num_seen - 1] = torch.bincount(data.y.cpu(), minlength=6).tolist()
        return data

    def update_memory(method, task, rt) -> None:
        memory, images = method.memory, rt.benchmark.train[task.id]
        seen = task.offset + task.num_classes
        count = ref.bic_exemplars_per_class(total, seen)
        method.eval()
        with torch.no_grad():  # the new model's features: the memory's exemplars (old classes), the task's images
            held = memory.labels[: memory.capacity].clone()
            training = (held >= 0) & ~memory.validation[: memory.capacity]
            slot_features = method.features(rt.test_tf(memory.images[: memory.capacity]), task.id)
            task_features = method.features(rt.test_tf(images.x), task.id)
        want = {}
        for c in range(seen):
            if c < task.offset:  # an old class: its exemplars in memory, where each came from
                slots = (training & (held == c)).nonzero().flatten()
                pool, sources = slot_features[slots], memory.source[slots]
            else:  # a new class: its images of the task, less the validation ones
                rows = [r for r in (images.y == c).nonzero().flatten().tolist() if r not in memory.held_out]
                first = sum(len(s) for s in rt.benchmark.train[: task.id])
                pool, sources = task_features[rows], torch.tensor(rows) + first
            want[c] = [int(sources[i]) for i in ref.herding_order(pool, count)]
        expected[task.id] = want
        real_update(method, task, rt)
        labels, order = memory.labels[: memory.capacity], memory.rank[: memory.capacity]
        training = (labels >= 0) & ~memory.validation[: memory.capacity]
        kept[task.id] = {}
        for c in range(seen):
            slots = (training & (labels == c)).nonzero().flatten()
            ranked = sorted(slots.tolist(), key=lambda slot: int(order[slot]))
            kept[task.id][c] = [int(memory.source[slot]) for slot in ranked]

    monkeypatch.setattr(task_module, "phase_data", phase_data)
    monkeypatch.setattr(task_module, "update_memory", update_memory)
    train(cfg, tmp_path)

    n_old = {1: 2, 2: 4}
    for t, counts in validation.items():
        per_class = ref.bic_validation_per_class(total, n_old[t])
        assert counts == [per_class] * (n_old[t] + 2) + [0] * (4 - n_old[t]), f"task {t}'s bias stage: {counts}"
    assert sorted(validation) == [1, 2]
    for t in (0, 1):
        assert kept[t] == expected[t], f"after task {t}: the memory's exemplars are not the official herding's"


# ------------------------------------------------------------------------------------------------------------ L2P-R
def test_l2p_r_replays_from_the_second_task_the_stored_views_over_every_class_training_the_whole_head(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2P Table 1's L2P-R row (its replay and memory settings from the preset) against the official code
    (train_continual.py L696-760, libml/continual_buffer.py): no replay in the first task (the buffer only fills);
    the buffer holds, of each task, per_class x classes of its first epoch's full-batch positions as the step saw them
    (augmented); a step of task 1 replays stored views as they are, its loss is the code's (one head over EVERY class,
    the batch's rows masked to the task, the replayed rows not) and every column of that head gets its gradient."""
    from clbench.loop import step as step_module
    from clbench.loop import train
    from clbench.methods.l2p import L2P

    keys = preset_keys(
        "l2p_table1_l2p_r_10", "method.replay_scope", "method.replay_first_task", "memory.view", "method.head_init"
    )
    batch, per_class = 16, 5
    cfg = tiny_config(
        "method=l2p", f"memory.per_class={per_class}", *keys, "trainer.eval_random_init=false", "data.train_crop=pad"
    )
    draws: list[int] = []
    first_epoch: list[torch.Tensor] = []
    at_task_1: dict[str, object] = {}
    real_draw, real_loss = step_module.draw_replay, L2P.training_loss

    def draw_replay(method, rt, current):
        draws.append(method.num_seen - 1)
        return real_draw(method, rt, current)

    def training_loss(self, x, y, task, replay=()):
        if task.id == 0 and len(first_epoch) < len(self.tasks[0].classes) * 30 // batch:
            first_epoch.append(x.detach().clone())
        if task.id == 1 and not at_task_1 and replay:
            at_task_1.update(method=copy.deepcopy(self), x=x.clone(), y=y.clone(), replay=replay)
        return real_loss(self, x, y, task, replay)

    monkeypatch.setattr(step_module, "draw_replay", draw_replay)
    monkeypatch.setattr(L2P, "training_loss", training_loss)
    train(cfg, tmp_path)

    replaying = [t for t in range(3) if ref.l2p_replays(t)]
    assert sorted(set(draws)) == replaying, f"replays during tasks {sorted(set(draws))}, the code's {replaying}"
    m = at_task_1["method"]
    memory, task = m.memory, m.tasks[1]
    # the first task's slots: per_class x 2 views, each exactly a row the first epoch's full batches trained on
    views = torch.cat(first_epoch)
    stored = memory.images[: per_class * 2]
    assert int((memory.tasks[: per_class * 2] == 0).sum()) == per_class * 2
    for image in stored:
        assert any(torch.equal(image, row) for row in views), "a stored image is not a view the first epoch saw"
    replay = at_task_1["replay"][0]
    held = memory.images[: memory.capacity][memory.labels[: memory.capacity] >= 0]
    for image in replay.x:  # replayed as stored, not augmented again
        assert any(torch.equal(image, row) for row in held)

    # the code's loss and gradient: one head (W, b) over the 6 classes of the benchmark
    heads = [p for h in m.trained_heads(task) for p in h.parameters()]
    assert len(heads) == 2 * len(m.tasks), "not every task's head is trained"
    W = torch.cat([h.weight for h in m.whole]).detach().clone().requires_grad_(True)
    b = torch.cat([h.bias for h in m.whole]).detach().clone().requires_grad_(True)
    x, y = at_task_1["x"], at_task_1["y"]
    rows, labels = torch.cat([x, replay.x]), torch.cat([y, replay.y])
    m.train()
    with torch.no_grad():
        q = m.query(rows)
        feats = m.prompted_features(rows, m.select(q, task))
    ce = ref.l2p_code_loss(feats @ W.T + b, labels, len(y), (task.offset, task.offset + task.num_classes))
    want = torch.autograd.grad(ce, [W, b])
    loss, logs = real_loss(m, x, y, task, (replay,))
    torch.testing.assert_close(loss - m.config.pull * logs["pull"], ce, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(loss, [h.weight for h in m.whole] + [h.bias for h in m.whole])
    k = len(m.whole)
    torch.testing.assert_close(torch.cat(got[:k]), want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat(got[k:]), want[1], rtol=1e-5, atol=1e-7)
    assert want[0][task.offset + task.num_classes :].abs().sum() > 0  # the future classes' columns are trained
