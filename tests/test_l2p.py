"""L2P: prompt pool sizes, query-key selection (per sample, batch-wise, diversified), losses, frozen backbone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clbench.errors import ConfigError
from clbench.loop import train
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.l2p import L2P
from clbench.methods.prompting import pull_loss
from conftest import tiny_config

L2P_TINY = ("method=l2p", "trainer.batch_size=16", "trainer.lr=1e-3")


def test_prompt_pool_has_the_papers_parameter_count() -> None:
    vit_b_width = ("backbone.kwargs.embed_dim=768", "backbone.kwargs.num_heads=12")
    method, _ = build_runtime(tiny_config(*L2P_TINY, *vit_b_width))
    assert method.prompts.numel() + method.keys.numel() == 46_080  # 10 x 5 x 768 + 10 x 768 (paper, Sec. 5.2)


def test_pull_loss_on_a_constructed_case() -> None:
    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    chosen = torch.tensor([[0, 1], [1, 2]])
    # sample 0: (1 - 1) + (1 - 0); sample 1: (1 - 1) + (1 - 0); divided by the batch of 2
    assert pull_loss(q, keys, chosen).item() == pytest.approx(1.0)


def constructed_selection(*overrides: str) -> L2P:
    method, _ = build_runtime(tiny_config(*L2P_TINY, "method.pool_size=4", "method.top_n=1", *overrides))
    with torch.no_grad():
        method.keys.zero_()
        method.keys[:, :4] = torch.eye(4)  # key j points along axis j
    return method


def test_selection_is_per_sample_unless_batchwise_is_asked_for() -> None:
    q = torch.zeros(3, 32)
    q[0, 0], q[1, 0], q[2, 1] = 1.0, 1.0, 1.0
    assert constructed_selection().select(q, None).flatten().tolist() == [0, 0, 1]
    batchwise = constructed_selection("method.batchwise_prompt=true")
    assert batchwise.select(q, None).flatten().tolist() == [0, 0, 0]  # the batch's majority


def test_frequency_diversification_and_task_slots() -> None:
    method = constructed_selection("method.diversify=frequency")
    task0, task1 = method.tasks[:2]
    q = torch.zeros(1, 32)
    q[0, 0], q[0, 1] = 1.0, 0.9  # closest to key 0, then key 1
    method.train_counts[0] = torch.tensor([90, 10, 0, 0])
    assert method.select(q, task0).item() == 0  # first task: no history, plain nearest key
    # (1 - cos) * h: key 0 is the nearest but most used; unused keys 2, 3 score 0
    assert method.select(q, task1).item() in (2, 3)
    assert method.select(q, None).item() == 0  # test time never diversifies
    slots = constructed_selection("method.diversify=task_slots")
    assert slots.select(q, slots.tasks[2]).flatten().tolist() == [2]
    with pytest.raises(ConfigError, match=r"pool_size"):
        build_runtime(tiny_config(*L2P_TINY, "method.pool_size=4", "method.diversify=task_slots"))


def test_training_masks_other_tasks_logits_and_leaves_the_backbone_untouched() -> None:
    method, rt = build_runtime(tiny_config(*L2P_TINY))
    frozen = {k: v.clone() for k, v in method.backbone.state_dict().items()}
    task0, task1 = rt.benchmark.tasks[:2]
    method.before_task(task0)
    run_task(method, task0, rt, epochs=1)
    method.after_task(task0)
    method.before_task(task1)
    method.param_groups(task1, method.phases(task1, 1)[0])
    x, y = rt.train_tf(rt.benchmark.train[1].x[:8]), rt.benchmark.train[1].y[:8]
    method.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss, logs = method.training_loss(x, y, task1)
    loss.backward()
    assert method.heads[0].weight.grad is None and method.prompts.grad is not None
    assert all(p.grad is None for p in method.backbone.parameters())
    feats = method.prompted_features(x, method.select(method.query(x), task1))
    expected = F.cross_entropy(method.heads[1](feats), y - task1.offset) + 0.5 * logs["pull"]
    assert torch.allclose(loss, expected, atol=1e-6)
    with torch.no_grad():
        method.heads[0].weight.mul_(100.0)  # another task's classes cannot change the loss
        again, _ = method.training_loss(x, y, task1)
    assert torch.allclose(loss, again)
    run_task(method, task1, rt, epochs=1)
    assert all(torch.equal(frozen[k], v) for k, v in method.backbone.state_dict().items())


def test_a_prediction_does_not_depend_on_the_rest_of_its_batch() -> None:
    method, rt = build_runtime(tiny_config(*L2P_TINY))
    for task in rt.benchmark.tasks[:2]:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
    method.eval()
    x = rt.test_tf(torch.cat([rt.benchmark.test[0].x[:4], rt.benchmark.test[1].x[:4]]))
    together = method.predict(x, None)
    alone = torch.cat([method.predict(x[i : i + 1], None) for i in range(len(x))])
    assert torch.allclose(together, alone, atol=1e-5)


def test_results_record_the_histograms_and_the_batchwise_flag(tmp_path: Path) -> None:
    train(tiny_config(*L2P_TINY, "trainer.epochs=1"), tmp_path)
    res = json.loads((tmp_path / "results.json").read_text())
    hist = res["l2p"]["prompt_histogram"]
    assert res["l2p"]["batchwise_prompt"] is False
    assert len(hist["train"]) == len(hist["test"]) == 3 and all(len(row) == 10 for row in hist["train"])
    assert all(sum(row) > 0 and sum(row) % 5 == 0 for row in hist["train"])  # N = 5 per image
    test_sizes = [len(t["classes"]) * 10 for t in res["tasks"]]  # synthetic_tiny: 10 test images per class
    assert [sum(row) for row in hist["test"]] == [5 * n for n in test_sizes]  # each test image selects once
    assert (tmp_path / "prompt_histogram.png").read_bytes()[:4] == b"\x89PNG"


def test_selection_counts_equal_bincount_without_sizing_from_the_data() -> None:
    """The histogram is bincount with a fixed length (torch.bincount sizes its output from the data: a host sync on
    CUDA in every training step)."""
    from clbench.methods.prompting import count_selections

    chosen = torch.tensor([[0, 3, 3], [9, 0, 1]])
    assert torch.equal(count_selections(chosen, 10), torch.bincount(chosen.flatten(), minlength=10))
