"""The honest protocol: a validation split that never touches train or test, objectives read on it, accuracy
counted with torchmetrics equal to plain counting, the diagnostics (top-5, per class, task confusion) from their
definitions, and SimpleCIL's prototypes equal to class means."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from clbench.config import validate
from clbench.data import Benchmark, Split, Task, build_benchmark
from clbench.errors import ConfigError
from clbench.evaluation import evaluate
from clbench.loop import train
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods import METHODS as ALL_METHODS
from clbench.methods.base import Method, init_head
from conftest import TINY, baselines_slow, clbench, compose_config, tiny_config


def indexed_benchmark(per_class: list[int]) -> Benchmark:
    """One task whose training image i carries its own index i in its pixels (so splits can be traced exactly)."""
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(per_class)])
    index = torch.arange(len(labels))
    x = torch.stack([index // 256, index % 256], 1).to(torch.uint8)[:, :, None, None]
    task = Task(0, tuple(range(len(per_class))), tuple(map(str, range(len(per_class)))), 0)
    test = Split(x[:3], labels[:3])
    return Benchmark("indexed", [task], [Split(x, labels)], [test])


def indices(split: Split) -> list[int]:
    return (split.x[:, 0, 0, 0].long() * 256 + split.x[:, 1, 0, 0].long()).tolist()


def test_the_validation_split_is_disjoint_stratified_and_seeded_by_its_own_seed() -> None:
    per_class = [40, 25, 7, 2]
    whole = indexed_benchmark(per_class)
    held = whole.hold_out_validation(0.2, seed=3)
    train_ids, val_ids = indices(held.train[0]), indices(held.validation[0])
    assert not set(train_ids) & set(val_ids) and sorted(train_ids + val_ids) == list(range(sum(per_class)))
    # stratified: round(0.2 n_c) of each class (at least one, never the class's last image)
    assert Counter(held.validation[0].y.tolist()) == {0: 8, 1: 5, 2: 1, 3: 1}
    assert held.test[0] is whole.test[0]  # the test set is not touched
    again = whole.hold_out_validation(0.2, seed=3)
    assert indices(again.validation[0]) == val_ids
    assert indices(whole.hold_out_validation(0.2, seed=4).validation[0]) != val_ids
    assert held.splits[-1]["validation"] == {
        "fraction": 0.2,
        "seed": 3,
        "per_task": [{"task": 0, "train_images": 59, "validation_images": 15}],
    }


def test_the_validation_split_does_not_depend_on_the_training_seed() -> None:
    def build(seed: int) -> Benchmark:
        return build_benchmark(validate(compose_config("data.val_fraction=0.1", f"seed={seed}")).data)

    a, b, none = build(0), build(1), build_benchmark(validate(compose_config()).data)
    for t in range(len(a.tasks)):
        assert torch.equal(a.validation[t].x, b.validation[t].x) and torch.equal(a.train[t].y, b.train[t].y)
        assert torch.equal(a.test[t].x, none.test[t].x)  # same test set as without a validation split
        assert len(a.train[t]) + len(a.validation[t]) == len(none.train[t])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("objective=cil.final_acc",), "objective_on_test=true"),
        (("objective=validation.cil.final_acc",), "data.val_fraction > 0"),
        (("objective=validation.cil.accuracy", "data.val_fraction=0.1"), "[validation.]<til|cil>."),
    ],
)
def test_an_objective_on_test_or_without_validation_data_is_refused(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match="`objective`") as err:
        validate(compose_config(*overrides))
    assert message in str(err.value)


def test_a_run_records_validation_matrices_and_its_objective(tmp_path: Path) -> None:
    cfg = tiny_config("data.val_fraction=0.2", "objective=validation.til.final_acc")
    train(cfg, tmp_path)
    res = json.loads((tmp_path / "results.json").read_text())
    validation = res["validation"]
    assert [len([v for v in row if v is not None]) for row in validation["acc_matrix"]["cil"]] == [1, 2, 3]
    assert validation["metrics"]["til"]["final_acc"] == pytest.approx(
        sum(validation["acc_matrix"]["til"][-1]) / 3, abs=1e-9
    )
    assert validation["acc_matrix"] != res["acc_matrix"]  # measured on other images
    assert res["objective"] == {"name": "validation.til.final_acc", "value": validation["metrics"]["til"]["final_acc"]}
    assert res["config"]["trainer"]["lr"] == cfg.trainer.lr and res["config"]["data"]["num_tasks"] == 3
    assert res["data_splits"][-1]["validation"]["fraction"] == 0.2


def test_a_test_objective_needs_the_opt_in_and_is_warned_about(tmp_path: Path) -> None:
    out = clbench(*TINY, "objective=cil.final_acc", "objective_on_test=true", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reads the TEST set" in out.stderr
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["objective"] == {"name": "cil.final_acc", "value": res["metrics"]["cil"]["final_acc"]}


METHODS = ALL_METHODS


@pytest.mark.parametrize("method", baselines_slow(METHODS))
def test_torchmetrics_counts_equal_plain_counts_and_the_diagnostics_follow_their_definitions(method: str) -> None:
    """Two tasks of five classes: accuracy, top-5 (10 classes in CIL), per-class accuracy and the task confusion,
    each recounted here from ``predict`` by its definition."""
    extra = ("method.retrain_epochs=1",) if method == "packnet" else ()
    method_, rt = build_runtime(
        tiny_config(f"method={method}", "data.tasks=2", "data.num_tasks=null", "trainer.epochs=1", *extra)
    )
    for task in rt.benchmark.tasks:
        method_.before_task(task)
        run_task(method_, task, rt, epochs=1)
        method_.after_task(task)
    got = rt.evaluate(method_, [0, 1])
    method_.eval()
    confusion = torch.zeros(2, 2)
    for j, task in enumerate(rt.benchmark.tasks):
        split = rt.benchmark.test[j]
        x = rt.test_tf(split.x, slice(None))
        til, cil = method_.predict(x, j), method_.predict(x, None)
        hits = {"til": til.argmax(1) + task.offset == split.y, "cil": cil.argmax(1) == split.y}
        for s in ("til", "cil"):
            assert got.accuracy[s][j] == 100.0 * hits[s].sum().item() / len(split)
            per_class = [
                100.0 * hits[s][split.y == c].sum().item() / (split.y == c).sum().item()
                for c in range(task.offset, task.offset + 5)
            ]
            assert got.per_class[s][5 * j : 5 * j + 5] == pytest.approx(per_class, abs=1e-9)
        assert got.top5["til"][j] is None  # five classes: top-5 is always right, so it is not reported
        if method_.task_conditioned:
            assert got.top5["cil"][j] is None
        else:
            in_top5 = (cil.topk(5, dim=1).indices == split.y[:, None]).any(1)
            assert got.top5["cil"][j] == 100.0 * in_top5.sum().item() / len(split)
        predicted_task = cil.argmax(1) // 5
        confusion[j] = torch.bincount(predicted_task, minlength=2).float() / len(split) * 100
    assert torch.allclose(torch.tensor(got.task_confusion, dtype=torch.float), confusion, atol=1e-4)
    assert [sum(row) for row in got.task_confusion] == pytest.approx([100.0, 100.0])


def test_simplecil_prototypes_are_the_class_means_of_frozen_features() -> None:
    method, rt = build_runtime(tiny_config("method=simplecil", "data.tasks=2", "data.num_tasks=null"))
    frozen = {k: v.clone() for k, v in method.backbone.state_dict().items()}
    for task in rt.benchmark.tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
    method.eval()
    for task, split in zip(rt.benchmark.tasks, rt.benchmark.train, strict=True):
        with torch.no_grad():
            feats = method.features(rt.test_tf(split.x, slice(None)), None)
        means = torch.stack([feats[split.y == task.offset + c].mean(0) for c in range(task.num_classes)])
        assert torch.allclose(method.heads[task.id].weight, means, atol=1e-5)
    assert all(torch.equal(v, frozen[k]) for k, v in method.backbone.state_dict().items())
    storage = method.storage()
    assert storage["trainable_params"] == 0
    assert storage["bits_per_task"] == [{"prototypes": 32 * 5 * method.backbone.num_features}] * 2


def official_hat_schedule(losses: list[float], lr: float, patience: int, factor: float, lr_min: float):
    """An independent transcription of HAT's epoch loop (joansj/hat, approaches/hat.py: train): the epoch whose
    weights are kept, the learning rate after each epoch, and the epoch it stopped at."""
    best_loss, best_epoch, wait, lrs = float("inf"), None, patience, []
    for e, loss in enumerate(losses):
        if loss < best_loss:
            best_loss, best_epoch, wait = loss, e, patience
        else:
            wait -= 1
            if wait <= 0:
                lr /= factor
                if lr < lr_min:
                    lrs.append(lr)
                    return best_epoch, lrs, e
                wait = patience
        lrs.append(lr)
    return best_epoch, lrs, len(losses) - 1


@pytest.mark.parametrize(
    "losses",
    [
        [1.0, 0.9, 0.95, 0.96, 0.8, 0.85, 0.86, 0.87, 0.88, 0.89, 0.9, 0.91],
        [2.0, 1.0, 0.5, 0.25],
        [1.0] * 12,
    ],
)
def test_the_plateau_schedule_follows_hats_official_loop(losses: list[float]) -> None:
    from torch import nn

    from clbench.plateau import Plateau

    lr, min_lr = 0.05, 0.05 / 3**2 - 1e-9  # two divisions allowed, the third stops
    best_epoch, lrs, stop = official_hat_schedule(losses, lr, patience=2, factor=3.0, lr_min=min_lr)
    plateau, model = Plateau(patience=2, factor=3.0), nn.Linear(1, 1)
    for e, loss in enumerate(losses):
        nn.init.constant_(model.weight, e)  # the weights of epoch e
        go_on = plateau.update(loss, model, lr, min_lr)
        assert lr * plateau.scale == pytest.approx(lrs[e])
        if not go_on:
            break
    assert e == stop
    plateau.restore_best(model)
    assert model.weight.item() == best_epoch


def test_hat_with_the_plateau_schedule_runs_and_needs_a_validation_split(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.val_fraction > 0"):
        tiny_config("method=hat", "trainer.schedule=plateau")
    cfg = tiny_config("method=hat", "trainer.schedule=plateau", "data.val_fraction=0.2", "trainer.epochs=4")
    results = train(cfg, tmp_path)
    assert results.status == "finished" and results.validation_rows is not None


class TwoFeatures(Method):
    """A method whose feature is the test image's two pixels and whose heads start at zero (the official JAX head):
    the logits of a trained head are what its weights say, the untrained classes' logits are 0."""

    def __init__(self, benchmark: Benchmark) -> None:
        backbone = torch.nn.Module()
        backbone.num_features, backbone.cls_token = 2, torch.nn.Parameter(torch.zeros(1))
        super().__init__(backbone, benchmark, None)

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        return x.flatten(1).float()

    def new_head(self, num_classes: int) -> torch.nn.Linear:
        head = super().new_head(num_classes)
        init_head(head, "zeros")
        return head


def test_cil_over_all_classes_counts_an_unseen_class_ahead_of_the_seen_ones_as_a_miss() -> None:
    """Two tasks of two classes, the first trained: the class-0 sample scores (-1, -2) on the seen classes (class 0 is
    right among the seen ones) and 0 on task 1's untrained classes, which wins the argmax over all classes (the
    official L2P and DualPrompt codes' CIL): a miss there, a hit over the seen classes; TIL is the same for both."""
    tasks = [Task(0, (0, 1), ("a", "b"), 0), Task(1, (2, 3), ("c", "d"), 2)]
    images = torch.tensor([[-1.0, -2.0], [0.0, 0.0]])
    split = Split(images, torch.tensor([0, 0]))
    bench = Benchmark("two", tasks, [split, split], [split, split])
    method = TwoFeatures(bench)
    method.before_task(tasks[0])
    with torch.no_grad():
        method.heads[0].weight.copy_(torch.eye(2))

    def accuracy(cil_classes: str) -> dict[str, list[float | None]]:
        kwargs = {"transform": lambda x, part: x[part], "batch_size": 4, "autocast": nullcontext()}
        return evaluate(method, bench, [0], **kwargs, cil_classes=cil_classes).accuracy

    # sample 0: seen logits (-1, -2) -> class 0 (hit); all classes (-1, -2, 0, 0) -> class 2 (miss)
    # sample 1: seen logits (0, 0) -> class 0 (ties go to the first); all classes (0, 0, 0, 0) -> class 0 (hit)
    assert accuracy("seen") == {"til": [100.0], "cil": [100.0]}
    assert accuracy("all") == {"til": [100.0], "cil": [50.0]}


def test_cil_over_all_classes_is_refused_for_a_method_that_infers_the_task() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.cil_classes.*seen with HAT"):
        validate(compose_config("method=hat", "trainer.cil_classes=all"))
