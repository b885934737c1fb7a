"""The documentation's worked example (docs/examples: MAS, a method kept outside the package) runs as a user runs it:
its folder on PYTHONPATH, its conf/ on Hydra's search path, ``clbench method=mas`` on the embedded default."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from conftest import clbench

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def test_the_documented_example_method_trains_and_learns(tmp_path: Path) -> None:
    """2 digit tasks of 2 classes (the second trains under the penalty), 2 epochs. Chance: a prediction that ignores the
    image is right for half of a task's test images in expectation (each task's two classes are balanced). The test
    set is 30% of scikit-learn's 1,797 digits (540 images), 2/5 of it in 2 of the 5 tasks: n = 216; guessing gives a
    mean accuracy of 50% with a standard deviation of 100·sqrt(0.25 / n) = 3.4 points. Learning means more than 5 of
    those above chance (67.0%)."""
    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    done = clbench(
        f"hydra.searchpath=[file://{EXAMPLES / 'conf'}]",
        "method=mas",
        "data.num_tasks=2",
        "trainer.epochs=2",
        "logger.mode=disabled",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        **env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "finished" and results["method_config"]["lam"] == 1.0
    n = math.ceil(0.3 * 1797) * 2 / 5  # scikit-learn's train_test_split rounds the test share up
    threshold = 50 + 5 * 100 * math.sqrt(0.25 / n)
    assert results["metrics"]["til"]["final_acc"] > threshold
    assert results["storage"]["shared_bits"]["omega"] > 0  # the importance the penalty reads is kept and reported
