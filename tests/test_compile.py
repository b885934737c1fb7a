"""`trainer.compile=true`: compiled blocks compute what eager ones do."""

from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters

from clbench.run import build_runtime, compile_blocks, run_task
from conftest import tiny_config


def test_compiled_and_eager_outputs_agree() -> None:
    method, rt = build_runtime(tiny_config("method=meat", "method.init=keep"))
    method.before_task(rt.benchmark.tasks[0])
    method.eval()
    x = rt.test_tf(rt.benchmark.test[0].x[:8])
    compiled = copy.deepcopy(method)
    compile_blocks(compiled)
    with torch.no_grad():
        assert torch.allclose(compiled.predict(x, 0), method.predict(x, 0), atol=1e-5)
        assert torch.allclose(compiled.predict(x, None), method.predict(x, None), atol=1e-5)
    assert counters["stats"]["unique_graphs"] > 0  # really compiled, not the eager fallback
    task = rt.benchmark.tasks[0]
    run_task(compiled, task, rt, epochs=1)  # training (Gumbel masks with gradients) runs compiled too
    compiled.after_task(task)
    assert torch.isfinite(compiled.predict(x, 0)).all()
