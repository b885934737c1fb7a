"""InfLoRA's rules (PTM spec part 1 §5.7) against an independent transcription of its official code
(tests/oracles/inflora_reference.py): the DualGPM's first basis, growth and switch to the complement as
``update_DualGPM`` computes them; A_t designed outside the old subspace; the whole method task after task (the input
moments, A_t, the subspaces, the k and v updates Σ B_s A_s) against the code's rules on the same inputs; old-task
inputs untouched by the new update; one forward a test image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clbench.errors import ConfigError
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.parts.dualgpm import Subspace, energy_threshold
from conftest import attention_ops, tiny_config
from oracles import inflora_reference as ref

F64 = torch.float64


def psd(d: int, spectrum: list[float], seed: int) -> torch.Tensor:
    """A d x d second moment Q diag(spectrum) Q^T with a random orthogonal Q."""
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=F64))
    values = torch.zeros(d, dtype=F64)
    values[: len(spectrum)] = torch.tensor(spectrum, dtype=F64)
    return q @ torch.diag(values) @ q.T


def projector(basis: torch.Tensor) -> torch.Tensor:
    return basis @ basis.T


def assert_same_subspace(ours: Subspace, feature: np.ndarray, kind: str) -> None:
    assert int(ours.size) == feature.shape[1] and bool(ours.retain) == (kind == "retain")
    torch.testing.assert_close(projector(ours.vectors()), projector(torch.tensor(feature)), rtol=0, atol=1e-8)


@pytest.mark.parametrize("threshold", [0.5, 0.9, 0.97, 0.999])
def test_the_first_basis_keeps_the_directions_below_the_energy_threshold(threshold: float) -> None:
    """Oracle 2: on a diagonal M with a known spectrum s, k = #{j : Σ_{i<=j} s_i^2 / Σ s^2 < ε} (at least one), the
    basis the first k axes; as the code's first update."""
    spectrum = [8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 0.0625]
    moment = torch.diag(torch.tensor(spectrum, dtype=F64))
    energy = np.cumsum(np.square(spectrum)) / np.square(spectrum).sum()
    k = max(int((energy < threshold).sum()), 1)
    ours = Subspace(16)
    ours.update(torch.block_diag(moment, torch.zeros(8, 8, dtype=F64)), threshold)
    assert int(ours.size) == k and not bool(ours.retain)
    torch.testing.assert_close(projector(ours.vectors()), torch.diag((torch.arange(16) < k).to(F64)))
    official = ref.DualGPM()
    official.update([torch.block_diag(moment, torch.zeros(8, 8, dtype=F64)).numpy()], threshold)
    assert_same_subspace(ours, official.feature_list[0], official.project_type[0])


def test_the_dualgpm_grows_switches_and_shrinks_as_the_codes() -> None:
    """Oracle 4 and the update rules: five tasks' moments (each spread over its own few directions) through clbench's
    Subspace and the code's update_DualGPM at the code's thresholds: the same dimension, kind and projector after each
    task, through a switch to the complement (more than d/2 = 6 directions) and updates of the complement after it."""
    d, tasks = 12, 5
    ours, official = Subspace(d), ref.DualGPM()
    kinds = []
    for t in range(tasks):
        moment = psd(d, [5.0, 3.0, 1.5, 0.4, 0.05], seed=t)
        threshold = ref.threshold(t, tasks, 0.9, 1.0)
        assert energy_threshold(t, tasks, 0.9, 1.0) == threshold
        ours.update(moment, threshold)
        official.update([moment.numpy()], threshold)
        assert_same_subspace(ours, official.feature_list[0], official.project_type[0])
        kinds.append((official.project_type[0], official.feature_list[0].shape[1]))
    assert kinds[0][0] == "remove" and kinds[-1][0] == "retain", kinds
    retained = [size for kind, size in kinds if kind == "retain"]
    assert retained[-1] < retained[0], kinds  # the complement shrank as later tasks took directions from it


def test_a_remove_basis_past_half_becomes_its_complement_with_the_same_projector() -> None:
    """A first task whose energy needs more than d/2 directions: the basis of the old subspace (k vectors) is stored as
    its complement (d − k vectors), P_retain = I − P_remove. (The code labels such a first basis "retain" without
    taking the complement, then stops at its own assertion; clbench takes the complement.)"""
    d = 8
    moment = torch.diag(torch.tensor([1.0] * 6 + [0.1, 0.05], dtype=F64))
    kept = Subspace(d)
    kept.update(moment, 0.999)  # the energy of 6 equal directions and a little: 6 of them, more than 4
    assert bool(kept.retain) and int(kept.size) == d - 6
    torch.testing.assert_close(projector(kept.vectors()), torch.diag(torch.tensor([0.0] * 6 + [1.0, 1.0], dtype=F64)))
    official = ref.DualGPM()
    with pytest.raises(AssertionError):
        official.update([moment.numpy()], 0.999)


@pytest.mark.parametrize("retain", [False, True])
def test_a_is_designed_outside_the_old_subspace_as_the_code_designs_it(retain: bool) -> None:
    """Oracle 1: with a "remove" basis U the rows of A are orthogonal to U; with a "retain" basis (the complement)
    they lie in its span; A^T A equals the code's (the singular vectors' signs aside) and its rows have norm 1/√3."""
    d, rank = 12, 3
    subspace, official = Subspace(d), ref.DualGPM()
    for seed, threshold in ((1, 0.9), (3, 0.99)) if retain else ((2, 0.6),):  # two tasks' directions: past d/2
        old = psd(d, [6.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3], seed=seed)
        subspace.update(old, threshold)
        official.update([old.numpy()], threshold)
    assert bool(subspace.retain) == retain == (official.project_type[0] == "retain")
    moment = psd(d, [9.0, 7.0, 5.0, 3.0, 2.0, 1.0], seed=5)
    a = subspace.design(moment, rank, 3**-0.5)
    expected = ref.design_a(moment, rank, official.feature_mat()[0], official.project_type[0])
    torch.testing.assert_close(a.T @ a, expected.T @ expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(a @ a.T, torch.eye(rank, dtype=F64) / 3)
    basis = subspace.vectors()
    outside = a @ basis if not retain else a - (a @ basis) @ basis.T
    assert outside.abs().max() < 1e-10


def run_with_oracle(*overrides: str) -> None:
    """A tiny InfLoRA run of three tasks (statistics passes without random augmentation), each step checked against
    the code's rules on the inputs the blocks really saw: the moments (the code's running cur_matrix), A_t of k and v,
    the DualGPM after the task, and every block's k and v updates Σ_{s<=t} B_s A_s."""
    method, rt = build_runtime(tiny_config("method=inflora", "backbone.kwargs.depth=2", "method.rank=4", *overrides))
    rt.train_tf = rt.test_tf
    official = ref.DualGPM()
    after = method.config.subspace_pass == "after"

    def block_inputs(task_id: int) -> list[torch.Tensor]:
        seen: dict[int, list[torch.Tensor]] = {}
        hooks = [
            w.register_forward_pre_hook(lambda module, args, i=i: seen.setdefault(i, []).append(args[0]))
            for i, w in enumerate(method.lora.wrappers)
        ]
        with torch.no_grad():
            for x, _ in rt.benchmark.train[task_id].batches(16):
                method.eval().features(rt.test_tf(x), task_id)
        for hook in hooks:
            hook.remove()
        return [ref.running_moment(seen[i]) for i in range(len(method.lora.wrappers))]

    for task in rt.benchmark.tasks:
        method.before_task(task)
        designed_from = block_inputs(task.id)
        run_task(method, task, rt, epochs=1)
        for i, wrapper in enumerate(method.lora.wrappers):
            feature = official.feature_mat()[i] if official.feature_list else None
            kind = official.project_type[i] if official.feature_list else None
            expected = ref.design_a(designed_from[i], 4, feature, kind).float()
            assert torch.equal(wrapper.a[0], wrapper.a[1])  # k and v share A_t
            torch.testing.assert_close(wrapper.a[0].T @ wrapper.a[0], expected.T @ expected, rtol=0, atol=1e-5)
        grown_from = block_inputs(task.id) if after else designed_from
        method.after_task(task)
        threshold = ref.threshold(task.id, len(method.tasks), method.config.lamb, method.config.lame)
        official.update([m.numpy() for m in grown_from], threshold)
        for subspace, feature, kind in zip(method.subspaces, official.feature_list, official.project_type, strict=True):
            assert_same_subspace(subspace, feature, kind)
    for wrapper in method.lora.wrappers:
        x = torch.randn(2, 5, wrapper.qkv.in_features)
        a = [*wrapper.bank_a[: len(method.tasks) - 1], wrapper.a.detach()]
        b = [*wrapper.bank_b[: len(method.tasks) - 1], wrapper.b.detach()]
        with torch.no_grad():
            out, base = wrapper(x), wrapper.qkv(x)
        d = wrapper.width
        torch.testing.assert_close(out[..., :d], base[..., :d], rtol=0, atol=0)  # q untouched
        for third, target in ((1, 0), (2, 1)):
            update = ref.kv_update(x, [t[target] for t in a], [t[target] for t in b])
            torch.testing.assert_close(
                out[..., third * d : (third + 1) * d], base[..., third * d : (third + 1) * d] + update
            )


def test_the_method_follows_the_codes_rules_task_after_task() -> None:
    run_with_oracle("trainer.epochs=1", "trainer.lr=0.01")


def test_the_subspace_from_the_design_pass_when_asked() -> None:
    """subspace_pass=before: the DualGPM grows from the moments recorded before B_t trained (no second pass)."""
    run_with_oracle("trainer.epochs=1", "trainer.lr=0.01", "method.subspace_pass=before")
    method, rt = build_runtime(tiny_config("method=inflora", "method.subspace_pass=before"))
    assert [p.name for p in method.phases(rt.benchmark.tasks[0], 1)] == ["design", "train"]


def test_old_inputs_are_untouched_by_the_new_update() -> None:
    """Oracle 3, interference-free: x in a block's old subspace (remove kind) gets B_t A_t x ≈ 0 from the task trained
    after it, however far B_t moved."""
    method, rt = build_runtime(tiny_config("method=inflora", "backbone.kwargs.depth=2", "trainer.lr=0.05"))
    for task in rt.benchmark.tasks[:2]:
        if task.id:
            bases = [s.vectors().clone() for s in method.subspaces]
            kinds = [bool(s.retain) for s in method.subspaces]
        method.before_task(task)
        run_task(method, task, rt, epochs=2)
        method.after_task(task)
    assert not any(kinds)
    for wrapper, basis in zip(method.lora.wrappers, bases, strict=True):
        x = (basis @ torch.randn(basis.shape[1], 6, dtype=F64)).T.float()  # 6 inputs in the old subspace
        for target in range(2):
            update = x @ (wrapper.b[target] @ wrapper.a[target]).T
            assert wrapper.b[target].abs().max() > 1e-3
            assert update.norm() <= 1e-5 * x.norm() * (wrapper.b[target] @ wrapper.a[target]).norm()


def test_only_b_and_the_tasks_head_train_and_a_test_image_costs_one_forward() -> None:
    method, rt = build_runtime(tiny_config("method=inflora", "backbone.kwargs.depth=2"))
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    run_task(method, task, rt, epochs=1)
    trained = {id(p) for group in method.param_groups(task, method.phases(task, 1)[1]) for p in group["params"]}
    assert trained == {id(w.b) for w in method.lora.wrappers} | {id(p) for p in method.heads[0].parameters()}
    assert not any(w.a.requires_grad for w in method.lora.wrappers)
    method.after_task(task)
    assert method.forwards_per_test_image() == {"til": 1, "cil": 1}
    x, y = rt.benchmark.train[0].batch(None, 0, 8)

    def step() -> None:  # a training step's forward and backward, taken again for each profile
        method.train().training_loss(rt.test_tf(x), y, task)[0].backward()

    fused, maps = attention_ops(step)
    assert fused and not maps, maps
    extra = method.extra_results()["inflora"]
    assert extra["threshold_per_task"] == [method.config.lamb]
    assert len(extra["subspace_size_per_task"][0]) == 2  # a size per block


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("method.lamb=1.5", "method.lamb"),
        ("method.lame=0.5", "method.lame"),
        ("method.subspace_pass=x", "method.subspace_pass"),
    ],
)
def test_bad_values_are_refused_before_any_work(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        tiny_config("method=inflora", override)
