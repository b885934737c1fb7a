"""RanPAC's rules (PTM spec part 1 §1.7) against an independent transcription of its official code
(tests/oracles/ranpac_reference.py): the ridge head from fp64 statistics, lambda chosen on each task's held-out rows as
``optimise_ridge_parameter`` chooses it, the random projection drawn from its seed, the statistics summed task by task
and rank by rank, the backbone frozen after the first session; its state through checkpoints and artifacts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clbench.errors import ConfigError
from clbench.loop import train
from clbench.loop.resume import replay
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.first_session import vit_features
from clbench.methods.parts.ridge import (
    RIDGES,
    HoldoutStatistics,
    RidgeStatistics,
    random_projection,
    relu_features,
    ridge_solve,
    select_ridge,
)
from conftest import tiny_config, trained_task_by_task
from oracles import ranpac_reference as ref

F64 = torch.float64


def test_without_projection_and_with_a_vanishing_ridge_the_head_is_least_squares() -> None:
    """M = 0, lambda -> 0, linearly independent features: W_o = argmin ||H W - Y||^2 (lstsq)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(40, 6, generator=gen, dtype=F64)
    y = torch.nn.functional.one_hot(torch.randint(0, 3, (40,), generator=gen), 3).to(F64)
    w = ridge_solve(h.T @ h, h.T @ y, 1e-12)
    torch.testing.assert_close(w, torch.linalg.lstsq(h, y).solution, rtol=1e-9, atol=1e-9)


def observed(h: torch.Tensor, y: torch.Tensor, classes: int, seed: int, batch: int = 7) -> HoldoutStatistics:
    """A task's rows observed in batches (positions 0..n-1), as the observe pass hands them over."""
    stats = HoldoutStatistics(h.shape[1], classes, len(h), fit=0.8, seed=seed, device=torch.device("cpu"))
    for start in range(0, len(h), batch):
        rows = torch.arange(start, min(start + batch, len(h)))
        stats.observe(h[rows], y[rows], rows)
    return stats


def in_held_out_order(stats: HoldoutStatistics, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The rows in the seeded order the split follows: the official code's loader order."""
    order = torch.argsort(stats.rank)
    return [t[order] for t in tensors]


def test_lambda_is_chosen_as_the_official_optimiser_chooses_it() -> None:
    """The first int(0.8 n) rows of the seeded order fit, the rest score; every candidate's MSE (averaged over all
    class columns) and the argmin as optimise_ridge_parameter computes them on the rows in that order."""
    gen = torch.Generator().manual_seed(1)
    n, m, classes = 53, 20, 5
    y = torch.randint(0, 3, (n,), generator=gen)  # classes 3, 4 unseen: zero columns, as in the code
    h = torch.relu(torch.randn(n, m, generator=gen, dtype=F64) + y[:, None].to(F64))
    stats = observed(h, y, classes, seed=4)
    assert stats.fitting == int(n * 0.8) and len(stats.held) == n - int(n * 0.8)
    chosen, losses = select_ridge(stats.gram, stats.cross, stats.held, stats.targets(), RIDGES)
    rows, labels = in_held_out_order(stats, h, y)
    expected, expected_losses = ref.optimise_ridge_parameter(rows, ref.target2onehot(labels, classes))
    assert chosen == expected
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-9, atol=1e-15)


def test_noise_free_features_take_the_smallest_lambda() -> None:
    """Labels an exact linear function of the features (their one-hot among the columns): the least-regularised
    fit is exact on the held-out rows, so lambda = 1e-8."""
    gen = torch.Generator().manual_seed(2)
    y = torch.randint(0, 4, (200,), generator=gen)
    h = torch.cat([torch.nn.functional.one_hot(y, 4).to(F64), torch.randn(200, 6, generator=gen, dtype=F64)], 1)
    stats = observed(h, y, 4, seed=0)
    assert select_ridge(stats.gram, stats.cross, stats.held, stats.targets(), RIDGES)[0] == 1e-8


def test_statistics_folded_task_by_task_and_rank_by_rank_are_the_whole_datas() -> None:
    """G and Q after three tasks equal H^T H and H^T Y of all their rows (fp64, up to summation order); two ranks
    that each observe their share of every batch add up to one process's sums (the held-out rows exactly)."""
    gen = torch.Generator().manual_seed(3)
    total = RidgeStatistics()
    total.allocate(12, 6, torch.device("cpu"))
    hs, ys = [], []
    for task in range(3):
        h = torch.relu(torch.randn(31, 12, generator=gen, dtype=F64))
        y = torch.randint(2 * task, 2 * task + 2, (31,), generator=gen)
        observed(h, y, 6, seed=task).fold_into(total)
        hs.append(h)
        ys.append(y)
    h, y = torch.cat(hs), torch.nn.functional.one_hot(torch.cat(ys), 6).to(F64)
    torch.testing.assert_close(total.gram, h.T @ h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total.cross, h.T @ y, rtol=1e-12, atol=1e-12)
    assert total.gram.dtype == total.cross.dtype == F64
    one = observed(hs[0], ys[0], 6, seed=9, batch=8)
    ranks = [HoldoutStatistics(12, 6, 31, fit=0.8, seed=9, device=torch.device("cpu")) for _ in range(2)]
    for start in range(0, 31, 8):
        rows = torch.arange(start, min(start + 8, 31))
        half = -(-len(rows) // 2)
        for rank, share in zip(ranks, (rows[:half], rows[half:]), strict=True):
            rank.observe(hs[0][share], ys[0][share], share)
    for mine, a, b in zip(one.sums(), *(r.sums() for r in ranks), strict=True):
        if mine.is_floating_point():
            torch.testing.assert_close(a + b, mine, rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(a + b, mine)
    assert torch.equal(ranks[0].held + ranks[1].held, one.held)


def test_the_projection_is_drawn_from_its_seed_alone_and_computed_in_fp32() -> None:
    w = random_projection(16, 5000, seed=7)
    assert torch.equal(w, random_projection(16, 5000, seed=7)) and not torch.equal(w, random_projection(16, 5000, 8))
    assert w.shape == (16, 5000) and abs(float(w.mean())) < 0.01 and abs(float(w.std()) - 1) < 0.01  # N(0, 1)
    phi = torch.randn(4, 16)
    h = relu_features(phi, w)
    assert h.shape == (4, 5000) and h.dtype == torch.float32 and (h >= 0).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(relu_features(phi, w), h)
    torch.testing.assert_close(h @ torch.eye(5000)[:3].T, ref.rp_logits(phi, w, torch.eye(5000)[:3]))


def run_tasks(*overrides: str) -> tuple:
    """A tiny RanPAC run, task by task as the loop runs it (the first session, the observe passes, after_task)."""
    cfg = tiny_config("method=ranpac", "method.M=40", "trainer.epochs=1", *overrides)
    return trained_task_by_task(cfg)


def test_the_head_is_the_officials_replace_fc_task_after_task() -> None:
    """Three tasks: with the features the observe pass saw (h = ReLU(phi W) in the seeded order), the official
    replace_fc gives the same lambda per task and the same head rows for every seen class; the CIL logits are
    h(x) · W_o as CosineLinear's use_RP forward."""
    method, rt = run_tasks("method.petl=none")
    method.eval()
    g = torch.zeros(40, 40, dtype=F64)
    q = torch.zeros(40, rt.benchmark.num_classes, dtype=F64)
    for task in rt.benchmark.tasks:
        split = rt.benchmark.train[task.id]
        with torch.no_grad():
            h = method.features(rt.test_tf(split.x), task.id).double()
        seed = hash((int(method.rp_seed), task.id)) % 2**63
        stats = HoldoutStatistics(40, rt.benchmark.num_classes, len(split), fit=0.8, seed=seed, device=rt.device)
        rows, labels = in_held_out_order(stats, h, split.y)
        seen = task.offset + task.num_classes
        g, q, ridge, wo = ref.replace_fc(g, q, rows, labels, None, total_classnum=rt.benchmark.num_classes, seen=seen)
        assert float(method.ridges[task.id]) == ridge, task.id
        _, losses = ref.optimise_ridge_parameter(rows, ref.target2onehot(labels, rt.benchmark.num_classes))
        torch.testing.assert_close(method.holdout_mse[task.id], torch.tensor(losses, dtype=F64), rtol=1e-6, atol=0)
    heads = torch.cat([head.weight for head in method.heads])
    torch.testing.assert_close(heads, wo.float(), rtol=1e-4, atol=1e-5)
    x = rt.test_tf(rt.benchmark.test[0].x[:5])
    phi = vit_features(method.backbone, x)
    torch.testing.assert_close(method.predict(x, None), ref.rp_logits(phi, method.projection, heads))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 features, but the projection and the head in fp32
        feats, logits = method.features(x, None), method.predict(x, None)
    assert feats.dtype == logits.dtype == torch.float32
    torch.testing.assert_close(logits, feats @ heads.T)
    assert method.extra_results()["ranpac"]["ridge_per_task"] == [float(r) for r in method.ridges]


def state_hash(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.detach().cpu().numpy().tobytes() for k, v in tensors.items()}


def test_after_the_first_session_only_the_head_changes() -> None:
    """Phase 1 moves the adapter; from then on the backbone, the adapter and the projection are bit-identical task
    after task (old classes' predictions change only through W_o, which every task rewrites)."""
    cfg = tiny_config("method=ranpac", "method.M=40", "trainer.epochs=1")
    method, rt = build_runtime(cfg)
    x = rt.test_tf(rt.benchmark.test[0].x)
    snapshots, heads = [], []
    for task in rt.benchmark.tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
        frozen = {f"backbone.{k}": v for k, v in method.backbone.state_dict().items()} | {"w": method.projection}
        snapshots.append(state_hash(frozen))
        heads.append(method.heads[0].weight.clone())
        method.eval()
        assert torch.equal(method.features(x, None), method.features(x, None))
    assert method.first.petl is not None and any(p.any() for n, p in method.first.petl.named.items() if "up." in n)
    assert snapshots[0] == snapshots[1] == snapshots[2]
    assert not torch.equal(heads[0], heads[1])  # task 0's classes' rows re-solved with task 1's statistics
    assert all(not p.requires_grad for p in method.parameters())


def test_a_checkpoint_replay_restores_the_statistics_and_the_seed_redraws_the_projection() -> None:
    method, rt = run_tasks()
    state = method.state_dict()
    assert {"stats.gram", "stats.cross", "rp_seed", "ridges", "holdout_mse"} <= state.keys()
    assert "projection" not in state  # drawn from the seed
    assert state["stats.gram"].dtype == F64 and state["stats.gram"].shape == (40, 40)
    fresh, _ = build_runtime(tiny_config("method=ranpac", "method.M=40", "trainer.epochs=1", "seed=5"))
    assert not torch.equal(fresh.projection, method.projection)  # another run's seed
    from clbench.checkpoint import Position

    replay(fresh, rt.benchmark.tasks, Position(task=len(rt.benchmark.tasks), step=0), epochs=1)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.projection, method.projection)  # redrawn from the loaded seed
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_the_artifacts_hold_what_evaluation_needs_and_not_the_statistics(tmp_path: Path) -> None:
    """The heads, the adapter and the projection's seed; not G or Q (test_run.py evaluates a finished run again from
    its folder with them, for every method)."""
    train(tiny_config("method=ranpac", "method.M=40", "trainer.epochs=1", "data.num_tasks=2"), tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "method_artifacts.safetensors")
    assert not any("gram" in k or "cross" in k for k in saved) and "rp_seed" in saved
    assert {k.split(".")[0] for k in saved} == {"head", "petl", "rp_seed", "ridges", "holdout_mse"}


def test_storage_states_the_ridge_heads_state() -> None:
    method, rt = run_tasks()
    storage = method.storage()
    assert storage["shared_bits"]["G"] == 64 * 40 * 40 and storage["shared_bits"]["projection_seed"] == 64
    assert storage["shared_bits"]["adapted_module"] == 32 * method.first.petl.numel()
    for task, entry in zip(rt.benchmark.tasks, storage["bits_per_task"], strict=True):
        assert entry == {"head": 32 * 40 * task.num_classes, "Q_columns": 64 * 40 * task.num_classes}


@pytest.mark.parametrize(
    ("override", "key"),
    [("method.M=-1", "method.M"), ("method.ridge=0", "method.ridge"), ("method.petl=finetune", "method.petl"),
     ("method.fit_fraction=1.0", "method.fit_fraction")],
)  # fmt: skip
def test_bad_values_are_refused_before_any_work(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        tiny_config("method=ranpac", override)
