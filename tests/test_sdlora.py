"""SD-LoRA's rules (PTM spec part 2 §3.7) against an independent transcription of its official code
(tests/oracles/sdlora_reference.py): the network of the code's ``_LoRA_qkv_timm_train`` with clbench's tensors gives
clbench's features, loss and gradients; the task boundary of the code's path (every earlier magnitude 0.8 again, the
finished direction normalised by ‖B‖_F ‖A‖_F) and of the default (the function carried over unchanged); only the q and
v thirds move; the merged evaluation equals the branch; the head's init; one forward a test image."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from clbench.errors import ConfigError
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.first_session import vit_features
from clbench.methods.sdlora import SDLoRA
from conftest import attention_ops, tiny_config
from oracles import sdlora_reference as ref

TINY_LORA = ("method=sdlora", "method.rank=4", "backbone.kwargs.depth=2", "trainer.lr=0.05", "trainer.epochs=1")


def trained(*overrides: str, tasks: int = 2) -> tuple[SDLoRA, object]:
    """An SD-LoRA run through its first ``tasks`` tasks (one epoch each), then the next task started."""
    method, rt = build_runtime(tiny_config(*TINY_LORA, *overrides))
    for task in rt.benchmark.tasks[:tasks]:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
    method.before_task(rt.benchmark.tasks[tasks])
    return method, rt


def official_network(
    method: SDLoRA, scaling: torch.Tensor, scaling_prev: list[torch.Tensor]
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The code's network at the current task from clbench's tensors, as leaves of its own: the pretrained ViT with
    every block's qkv the code's ``_LoRA_qkv_timm_train`` over the earlier pairs (raw, as the code saves them) and the
    current one (q: target 0, v: target 1). Returns it and its current pairs' (A_q, B_q, A_v, B_v) of every block."""
    vit = copy.deepcopy(method.backbone)
    earlier = method.num_seen - 1
    leaves = []
    for block, wrapper in zip(vit.blocks, method.lora.wrappers, strict=True):
        bank_a, bank_b = wrapper.bank_a.clone(), wrapper.bank_b.clone()
        saved = [(bank_a[i, 0], bank_b[i, 0], bank_a[i, 1], bank_b[i, 1]) for i in range(earlier)]
        current = tuple(
            t.detach().clone().requires_grad_(True) for t in (wrapper.a[0], wrapper.b[0], wrapper.a[1], wrapper.b[1])
        )
        leaves += current
        block.attn.qkv = ref.LoRAQKVTrain(copy.deepcopy(wrapper.qkv), saved, current, scaling, scaling_prev)
    return vit, leaves


def test_the_codes_path_rebuilds_every_earlier_component_at_magnitude_0_8_and_normalised() -> None:
    """Oracles 1 and 5: with alpha_carry=reset the network at the start of task 2 (B_2 = 0) is the code's rebuilt one,
    every α' a fresh 0.8 and each earlier pair's direction B A / (‖B‖_F ‖A‖_F)."""
    method, rt = trained("method.alpha_carry=reset")
    x = rt.test_tf(rt.benchmark.test[0].x[:6])
    official, _ = official_network(method, *ref.update_network_scalings())
    with torch.no_grad():
        ours = vit_features(method.eval().backbone, x)
        torch.testing.assert_close(ours, vit_features(official.eval(), x), rtol=1e-5, atol=1e-5)
    assert method.alpha.bank[:2].tolist() == pytest.approx([ref.ALPHA] * 2)
    assert float(method.alpha.current.detach()) == pytest.approx(ref.ALPHA)


def test_by_default_the_function_carries_over_the_boundary_and_the_learnt_magnitudes_are_kept() -> None:
    """alpha_carry=keep: the logits after before_task(2) equal those task 1 ended with, and the finished component's
    magnitude is the one it learnt; with reset they differ (the jump the code makes before any training)."""
    for carry, continuous in (("keep", True), ("reset", False)):
        method, rt = trained(f"method.alpha_carry={carry}", tasks=1)
        task = rt.benchmark.tasks[1]
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
        x = rt.test_tf(rt.benchmark.test[0].x[:6])
        learnt = float(method.alpha.current.detach())
        before = method.eval().predict(x, None)
        method.before_task(rt.benchmark.tasks[2])
        after = method.eval().predict(x, None)[:, : before.shape[1]]
        assert torch.allclose(after, before, rtol=1e-5, atol=1e-5) == continuous, carry
        if carry == "keep":
            assert float(method.alpha.bank[1].detach()) == learnt != pytest.approx(ref.ALPHA)
            assert method.magnitudes()[1] == learnt


def test_logits_loss_and_gradients_are_the_codes_network_on_the_same_tensors() -> None:
    """Task 2 trained for an epoch on the code's path: the code's forward with clbench's tensors gives clbench's
    features, its loss (``_update_representation``: the new classes' logits, shifted labels) and the gradients of
    every trained tensor: A_t and B_t of every block, α_t, each earlier α_i, the task's head; old heads get none."""
    method, rt = trained("method.alpha_carry=reset")
    task = rt.benchmark.tasks[2]
    run_task(method, task, rt, epochs=1)
    method.train()
    x_raw, y = rt.benchmark.train[2].batch(None, 0, 8)
    x = rt.test_tf(x_raw)
    loss, _ = method.training_loss(x, y, task)
    method.zero_grad(set_to_none=True)
    loss.backward()
    scaling = method.alpha.current.detach().reshape(1).clone().requires_grad_(True)
    scaling_prev = [method.alpha.bank[i].detach().reshape(1).clone().requires_grad_(True) for i in range(2)]
    official, leaves = official_network(method, scaling, scaling_prev)
    weights = [h.weight.detach().clone().requires_grad_(True) for h in method.heads]
    biases = [h.bias.detach().clone().requires_grad_(True) for h in method.heads]
    logits = torch.nn.functional.linear(vit_features(official.train(), x), torch.cat(weights), torch.cat(biases))
    expected = ref.loss(logits, y, task.offset, task.id)
    expected.backward()
    close = {"rtol": 1e-4, "atol": 1e-6}
    torch.testing.assert_close(loss.detach(), expected.detach(), **close)
    torch.testing.assert_close(method.alpha.current.grad.reshape(1), scaling.grad, **close)
    torch.testing.assert_close(method.alpha.bank.grad[:2], torch.cat([s.grad for s in scaling_prev]), **close)
    assert not method.alpha.bank.grad[2:].any()  # unused slots
    ours = [t for w in method.lora.wrappers for t in (w.a.grad[0], w.b.grad[0], w.a.grad[1], w.b.grad[1])]
    for mine, theirs in zip(ours, leaves, strict=True):
        torch.testing.assert_close(mine, theirs.grad, **close)
    assert all(g.abs().max() > 0 for g in (*ours, method.alpha.current.grad, method.alpha.bank.grad[:2]))
    torch.testing.assert_close(method.heads[2].weight.grad, weights[2].grad, **close)
    assert method.heads[0].weight.grad is None and not weights[0].grad.any()  # old rows: no gradient in the code


def test_the_default_bank_adds_each_learnt_update_with_its_magnitude() -> None:
    """keep, from first principles: each block's q and v get Σ_i α_i B_i A_i x + α_t B_t A_t x, k nothing."""
    method, rt = trained()
    run_task(method, rt.benchmark.tasks[2], rt, epochs=1)
    wrapper = method.lora.wrappers[1]
    x = torch.randn(3, 5, wrapper.qkv.in_features)
    alphas = [*method.alpha.bank[:2].detach(), method.alpha.current.detach()]
    pairs = [(wrapper.bank_a[i], wrapper.bank_b[i]) for i in range(2)] + [(wrapper.a.detach(), wrapper.b.detach())]
    base = wrapper.qkv(x).detach()
    d = wrapper.width
    with torch.no_grad():
        out = wrapper(x)
    for third, target in ((0, 0), (2, 1)):
        update = sum(alpha * x @ (b[target] @ a[target]).T for alpha, (a, b) in zip(alphas, pairs, strict=True))
        torch.testing.assert_close(
            out[..., third * d : (third + 1) * d], base[..., third * d : (third + 1) * d] + update
        )
    assert torch.equal(out[..., d : 2 * d], base[..., d : 2 * d])  # oracle 2: the k third is the frozen layer's


def test_the_merged_weight_equals_the_branch_and_only_q_and_v_move() -> None:
    """Oracles 2 and 3: evaluation merges every component into W_qkv (one ViT forward); training runs the branch;
    both give the same output, whose k third is the pretrained projection's exactly."""
    method, _ = trained()
    for wrapper in method.lora.wrappers:
        with torch.no_grad():
            wrapper.b.normal_()  # a current component that has moved
        x = torch.randn(4, 7, wrapper.qkv.in_features)
        branch = wrapper(x)
        with torch.no_grad():
            merged = wrapper(x)
        torch.testing.assert_close(merged, branch.detach(), rtol=1e-5, atol=1e-5)
        d = wrapper.width
        assert torch.equal(branch[..., d : 2 * d], wrapper.qkv(x)[..., d : 2 * d])
        assert not torch.allclose(branch[..., :d], wrapper.qkv(x)[..., :d])


def test_a_test_image_costs_one_forward_and_attention_stays_fused() -> None:
    method, rt = trained()
    assert method.forwards_per_test_image() == {"til": 1, "cil": 1}
    calls = []
    method.backbone.patch_embed.register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    x = rt.test_tf(rt.benchmark.test[1].x)
    method.eval().predict_scenarios(x, 1, ("til", "cil"))
    assert calls == [len(x)]
    task = rt.benchmark.tasks[2]
    x, y = rt.benchmark.train[2].batch(None, 0, 8)

    def step() -> None:  # a training step's forward and backward, taken again for each profile
        method.train().training_loss(rt.test_tf(x), y, task)[0].backward()

    fused, maps = attention_ops(step)
    assert fused and not maps, maps


def test_the_head_is_the_codes_simple_linear() -> None:
    """``SimpleLinear``: Kaiming-uniform with the linear gain, U(±√(3/d)), bias 0."""
    method, _ = build_runtime(tiny_config("method=sdlora"))
    head = method.new_head(500)
    got, bias = head.weight.detach(), head.bias.detach()
    bound = math.sqrt(3 / head.in_features)
    assert got.abs().max() <= bound and got.abs().max() > 0.95 * bound
    assert not bias.any()
    weight, _ = ref.simple_linear(head.in_features, 500, torch.Generator().manual_seed(0))
    assert abs(float(weight.std()) - float(got.std())) < 0.05 * bound


def test_storage_and_results_state_the_components_and_magnitudes() -> None:
    method, _ = trained(tasks=2)
    per_task = method.storage()["bits_per_task"]
    lora_floats = sum(2 * (4 * w.qkv.in_features + w.width * 4) for w in method.lora.wrappers)
    assert [entry["lora"] for entry in per_task] == [32 * lora_floats] * 3
    assert all(entry["magnitude"] == 32 for entry in per_task)
    extra = method.extra_results()["sdlora"]
    assert extra["alpha_carry"] == "keep" and len(extra["alpha_per_task"]) == 3


@pytest.mark.parametrize(
    ("override", "key"),
    [("method.alpha_carry=drop", "method.alpha_carry"), ("method.rank=0", "method.rank")],
)
def test_bad_values_are_refused_before_any_work(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        tiny_config("method=sdlora", override)
