"""HAT: annealing, compensation, the capacity regulariser, gradient masking and old-task protection."""

from __future__ import annotations

import math

import pytest
import torch

from clbench.errors import ConfigError
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.hat import HAT, annealed_s, capacity, compensation
from conftest import tiny_config


def test_annealing_runs_from_one_over_s_max_to_s_max_within_each_epoch() -> None:
    assert annealed_s(0, 10, 400.0) == pytest.approx(1 / 400)
    assert annealed_s(9, 10, 400.0) == pytest.approx(400.0)
    assert annealed_s(1, 3, 400.0) == pytest.approx((1 / 400 + 400) / 2)
    assert annealed_s(0, 1, 400.0) == 400.0


def test_compensation_matches_the_formula_and_clamps() -> None:
    e = torch.tensor([0.0, 0.5, -2.0])
    s, s_max = 2.0, 400.0
    expected = [s_max * (math.cosh(s * v) + 1) / (s * (math.cosh(v) + 1)) for v in e.tolist()]
    assert torch.allclose(compensation(e, s, s_max, 50.0), torch.tensor(expected))
    # |s e| beyond thres_cosh is clamped: the factor stays finite
    big = compensation(torch.tensor([6.0]), 400.0, 400.0, 50.0)
    assert torch.isfinite(big).all() and big.item() == pytest.approx((math.cosh(50) + 1) / (math.cosh(6) + 1), rel=1e-5)


def test_capacity_regulariser_on_constructed_gates() -> None:
    used = [torch.tensor([1.0, 1.0, 0.0, 0.0])]
    # all units the new task opens were already used: nothing new is reserved
    assert capacity([torch.tensor([1.0, 1.0, 0.0, 0.0])], used).item() == 0.0
    # one of the two free units opened: 1 / 2
    assert capacity([torch.tensor([1.0, 0.0, 1.0, 0.0])], used).item() == pytest.approx(0.5)
    # first task: sum a / number of units, across layers
    first = capacity([torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5, 0.0])], [torch.zeros(2), torch.zeros(3)])
    assert first.item() == pytest.approx(2.0 / 5)


def test_bad_units_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"method\.units"):
        tiny_config("method=hat", "method.units=[qkv,heads]")
    with pytest.raises(ConfigError, match=r"method\.s_max"):
        tiny_config("method=hat", "method.s_max=0.5")


@pytest.mark.parametrize("units", ["[mlp,qkv]", "[mlp,heads]"])
def test_gradient_masking_zeroes_exactly_the_protected_entries(units: str) -> None:
    method, rt = build_runtime(tiny_config("method=hat", f"method.units={units}"))
    assert isinstance(method, HAT)
    t0, t1 = rt.benchmark.tasks[:2]
    method.before_task(t0)
    method.after_task(t0)
    used = {}
    for key, n in method.units.items():  # a constructed cumulative mask: every other unit fully used
        used[key] = (torch.arange(n) % 2 == 0).float()
        method.cumulative(key).copy_(used[key])
    method.before_task(t1)
    method.param_groups(t1, method.phases(t1, 1)[0])
    method.train()
    x, y = rt.train_tf(rt.benchmark.train[1].x[:16]), rt.benchmark.train[1].y[:16]
    loss, _ = method.training_loss(x, y, t1)
    loss.backward()
    method.after_backward(t1)
    block = method.backbone.blocks[0]
    fc1, fc2 = block.mlp.fc1, block.mlp.fc2
    hidden_used = used["blocks_0_mlp"].bool()
    assert (fc1.weight.grad[hidden_used] == 0).all() and (fc1.weight.grad[~hidden_used] != 0).any()
    assert (fc1.bias.grad[hidden_used] == 0).all()
    assert (fc2.weight.grad[:, hidden_used] == 0).all() and (fc2.weight.grad[:, ~hidden_used] != 0).any()
    attn = block.attn
    qkv = attn.qkv.inner if hasattr(attn.qkv, "inner") else attn.qkv
    proj = attn.proj.inner if hasattr(attn.proj, "inner") else attn.proj
    gate = used["blocks_0_attn"].bool()
    dim, heads = proj.in_features, attn.num_heads
    rows = gate if units == "[mlp,qkv]" else gate.repeat_interleave(dim // heads).repeat(3)
    cols = gate[2 * dim :] if units == "[mlp,qkv]" else gate.repeat_interleave(dim // heads)
    assert (qkv.weight.grad[rows] == 0).all() and (qkv.weight.grad[~rows] != 0).any()
    assert (proj.weight.grad[:, cols] == 0).all() and (proj.weight.grad[:, ~cols] != 0).any()
    # parameters every task shares are frozen after the first task
    assert not block.norm1.weight.requires_grad and not fc2.bias.requires_grad and not proj.bias.requires_grad
    assert not method.backbone.pos_embed.requires_grad and not method.backbone.patch_embed.proj.weight.requires_grad


@pytest.mark.parametrize(
    ("overrides", "drift"),
    [((), 1e-5), (("trainer.optimizer=adamw", "trainer.weight_decay=0.1", "method.units=[mlp,heads]"), 0.02)],
    ids=["sgd", "adamw-wd-heads"],
)
def test_old_tasks_keep_their_predictions(overrides: tuple[str, ...], drift: float) -> None:
    """Old tasks' TIL logits barely move (plain SGD: float noise; AdamW: only the few units whose cumulative
    gate is fractional move), accuracy drops at most 1 point, shared parameters are bit-identical."""
    method, rt = build_runtime(tiny_config("method=hat", "trainer.lr=0.05", *overrides))
    tasks = rt.benchmark.tasks
    inputs = [rt.test_tf(rt.benchmark.test[t.id].x) for t in tasks]
    shared: dict[str, torch.Tensor] = {}
    acc: list[list[float]] = []
    logits: list[torch.Tensor] = []
    for task in tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=3)
        method.after_task(task)
        acc.append(rt.evaluate(method, list(range(task.id + 1)), ("til",)).accuracy["til"])
        logits.append(method.predict(inputs[task.id], task.id))
        state = method.backbone.state_dict()
        if task.id == 0:
            shared = {k: v.clone() for k, v in state.items() if "norm" in k or "embed" in k or "fc2.bias" in k}
        assert all(torch.equal(v, state[k]) for k, v in shared.items())
        for old in range(task.id):
            moved = (method.predict(inputs[old], old) - logits[old]).abs().max()
            assert moved <= drift * logits[old].abs().max(), f"task {old} moved {moved} after task {task.id}"
    assert acc[0][0] > 60, acc  # it learned something worth protecting
    for j in range(len(tasks) - 1):
        assert acc[-1][j] >= acc[j][j] - 1.0, acc
    logits_cil = method.predict(inputs[0][:4], None)  # CIL: the generic lowest-entropy task inference
    assert logits_cil.shape == (4, 6) and torch.isinf(logits_cil).sum(1).eq(4).all()
    storage = method.storage()["bits_per_task"]
    assert all(entry["gates"] == sum(method.units.values()) for entry in storage)
