"""The paper presets (experiment=...) build their benchmark from files in the real on-disk layout and take a
training step on CPU (with a shrunken backbone: the data pipeline, transforms and recipe are the preset's own)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from clbench.config import validate
from clbench.run import build_optimizer, build_runtime, train_step
from conftest import compose_config
from test_data import write_cifar100

SHRINK = (
    "backbone.pretrained=false",
    "+backbone.kwargs.depth=1",
    "+backbone.kwargs.embed_dim=32",
    "+backbone.kwargs.num_heads=2",
    "trainer.batch_size=8",
    "logger.mode=disabled",
)


def official_split(seed: int, tasks: int) -> list[list[int]]:
    """RandSplitCIFAR100 (RAIVNLab/supsup, data/partitioncifar.py): np.random.seed(seed); perm = permutation(100)."""
    np.random.seed(seed)
    perm = np.random.permutation(100)
    size = 100 // tasks
    return [perm[size * i : size * (i + 1)].tolist() for i in range(tasks)]


@pytest.mark.parametrize(
    ("preset", "classes", "test_size"),
    [
        ("l2p_cifar100_paper", [list(range(10 * i, 10 * i + 10)) for i in range(10)], 224),  # the natural order
        ("supsup_splitcifar100_paper", official_split(0, 20), 32),
    ],
)
def test_a_paper_preset_reads_the_real_layout_and_takes_a_step(
    tmp_path: Path, preset: str, classes: list[list[int]], test_size: int
) -> None:
    write_cifar100(tmp_path)
    cfg = validate(
        compose_config(f"experiment={preset}", f"data.root={tmp_path}", "data.verify_checksums=false", *SHRINK)
    )
    method, rt = build_runtime(cfg)
    assert [list(t.classes) for t in rt.benchmark.tasks] == classes
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    phase = method.phases(task, cfg.trainer.epochs)[0]
    method.before_phase(task, phase)
    optimizer = build_optimizer(method, method.param_groups(task, phase), cfg.trainer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    x, y = rt.benchmark.train[0].batch(None, 0, cfg.trainer.batch_size)
    loss, _ = train_step(method, task, rt, x, y, optimizer=optimizer, params=params)
    assert torch.isfinite(loss)
    assert rt.test_tf(rt.benchmark.test[0].x[:2]).shape == (2, 3, test_size, test_size)
