"""Test-time cost: each method's declared backbone passes per test image equal the passes its ``predict`` makes (counted
at the patch embedding every ViT pass goes through), and results.json records them with the stored state per stage."""

from __future__ import annotations

import pytest
import torch
from timm.layers import PatchEmbed

from clbench.loop.resume import finish_untrained
from clbench.loop.runtime import build_runtime
from clbench.methods import METHODS
from clbench.methods.base import Method
from clbench.results import Results
from conftest import tiny_config


def passes(method: Method, x: torch.Tensor, task_id: int | None) -> int:
    """Backbone forward passes ``predict(x, task_id)`` makes: calls of any patch embedding in the method (a backbone
    copy has its own)."""
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in method.modules() if isinstance(m, PatchEmbed)]
    try:
        method.predict(x, task_id)
    finally:
        for hook in hooks:
            hook.remove()
    return len(calls)


@pytest.mark.parametrize(
    "overrides",
    [
        *[(f"method={m}",) for m in METHODS],
        ("method=supsup", "method.inference=binary"),
        ("method=supsup", "method.inference=lowest_entropy"),
        ("method=ease", "method.ptm_block=true"),
        ("method=ease", "method.aper_mode=true"),
        ("method=mos", "method.proto_branch=ptm"),
    ],
    ids=" ".join,
)
def test_the_declared_forwards_per_test_image_are_the_passes_predict_makes(overrides: tuple[str, ...]) -> None:
    method, rt = build_runtime(tiny_config(*overrides, "data.num_tasks=3"))
    x = rt.test_tf(rt.benchmark.test[0].x[:1])
    method.eval()
    for task in rt.benchmark.tasks:
        method.before_task(task)
        finish_untrained(method, task)
        counted = {"til": passes(method, x, task.id), "cil": passes(method, x, None)}
        assert method.forwards_per_test_image() == counted, f"after task {task.id}"


def test_each_stage_records_its_forwards_and_the_state_stored_per_task() -> None:
    """A hand-made storage (bits per component, per task; shared bits; a rehearsal memory in bytes) after task 1."""
    results = Results({}, [])
    results.rows = {"til": [[1.0], [1.0, 1.0]], "cil": [[1.0], [1.0, 1.0]]}  # two stages done
    storage = {
        "bits_per_task": [{"head": 640, "masks": 1000}, {"head": 640, "masks": 500}],
        "shared_bits": {"g_prompt": 32},
        "trainable_params": 7,
        "memory": {
            "sampler": "reservoir",
            "samples": 3,
            "bytes_images": 300,
            "bytes_labels": 24,
            "per_class_counts": [3],
        },
    }
    results.record_cost({"til": 1, "cil": 2}, storage)
    results.record_cost({"til": 1, "cil": 2}, storage)  # a stage recorded again (a resumed run) replaces its entry
    assert results.test_time_cost == [
        {
            "after_task": 1,
            "forwards_per_test_image": {"til": 1, "cil": 2},
            "stored_bits_per_task": [1640, 1140],
            "shared_bits": 32,
            "memory_bits": 8 * 324,
        }
    ]
