"""A checkpoint that does not match what was written is refused at resume before any work, naming the file and what
is wrong, and the folder is left as it was: bytes changed on disk or values edited (its integrity record), and values
that no run writes even where the record was rewritten to match them (shapes, missing tensors, a memory's labels and
count, the results' stages)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from clbench import checkpoint
from clbench.errors import DataError
from clbench.loop import run as run_module
from clbench.loop import train
from clbench.state_digest import digests
from conftest import TINY, clbench, tiny_config
from test_faults import refused, snapshot

ER = ("method=er", "memory.per_class=4", "data.num_tasks=2", "trainer.epochs=1")


@pytest.fixture
def stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ER run stopped at task 1's start (a power cut), its checkpoint written after task 0: a memory holding task
    0's images, to be resumed."""
    real = run_module.start_task

    def cut(method, task, rt, results) -> None:
        if task.id == 1:
            raise RuntimeError("power cut")
        real(method, task, rt, results)

    monkeypatch.setattr(run_module, "start_task", cut)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_config(*ER), tmp_path / "run")
    monkeypatch.undo()
    return tmp_path / "run"


def edit(path: Path, change: Callable[[dict[str, Any]], None], *, rewrite_record: bool) -> None:
    """Load the checkpoint, ``change`` its state and save it again with its integrity record as written, or
    (``rewrite_record``) recomputed to match the change: a checkpoint written wrong rather than damaged."""
    state = torch.load(path, weights_only=True)
    record = state.pop("integrity", None)
    change(state)
    state["integrity"] = digests(state) if rewrite_record else record
    torch.save(state, path)


def refused_before_any_work(folder: Path, match: str) -> None:
    before = snapshot(folder)
    with pytest.raises(DataError, match=match):
        train(tiny_config(*ER, "resume=true"), folder)
    assert snapshot(folder) == before


def memory(state: dict[str, Any]) -> dict[str, Any]:
    return state["method"]


def test_a_byte_flipped_on_disk_in_the_memorys_images_is_refused_naming_them(stopped: Path) -> None:
    """torch.load reads a flipped byte of a tensor's data without a word: the resumed run went on with other images."""
    path = stopped / checkpoint.FILE
    images = torch.load(path, weights_only=True)["method"]["memory.images"]
    raw = bytearray(path.read_bytes())
    at = raw.find(images[0].numpy().tobytes()[:64])
    assert at > 0
    raw[at + 7] ^= 0xFF
    path.write_bytes(bytes(raw))
    refused_before_any_work(
        stopped, r"checkpoint\.pt does not match what was written .*: method/memory\.images changed"
    )


CASES = {
    "held 0": (lambda s: memory(s)["memory._extra_state"].update(held=0), r"memory\._extra_state/held changed"),
    "5 rows short": (
        lambda s: memory(s).update({"memory.images": memory(s)["memory.images"][:-5].clone()}),
        r"method/memory\.images changed",
    ),
    "labels removed": (lambda s: memory(s).pop("memory.labels"), r"method/memory\.labels is missing"),
    "labels 99": (lambda s: memory(s)["memory.labels"].fill_(99), r"method/memory\.labels changed"),
    "labels -1": (lambda s: memory(s)["memory.labels"].fill_(-1), r"method/memory\.labels changed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_edited_checkpoint_is_refused_by_its_integrity_record(stopped: Path, case: str) -> None:
    change, match = CASES[case]
    edit(stopped / checkpoint.FILE, change, rewrite_record=False)
    refused_before_any_work(stopped, rf"checkpoint\.pt does not match what was written .*{match}")


WRONG = {  # what the run the config builds, or the memory's own rules, say (the record rewritten to match)
    "held 0": r"holds what no run writes: a memory count of 0 held images where its labels fill 16 of its slots",
    "5 rows short": r"does not fit the run its config builds: size mismatch for memory\.images: .*"
    r"torch\.Size\(\[12, 3, 16, 16\]\) from checkpoint, the shape in current model is torch\.Size\(\[17, 3, 16, 16\]\)",
    "labels removed": r"does not fit the run its config builds: Missing key\(s\) in state_dict: \"memory\.labels\"",
    "labels 99": r"holds what no run writes: memory labels \[99\] outside -1 \(empty\) \.\. 3",
    "labels -1": r"holds what no run writes: a memory count of \d+ held images where its labels fill 0 of its slots",
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_written_wrong_is_refused_by_what_the_run_and_the_memory_allow(stopped: Path, case: str) -> None:
    """ER's reservoir memory: 4 images a class x 4 classes (two tasks of two) = 16 slots and a scratch row (17 rows),
    all 16 filled by task 0's images (more than 16 offered, taken in order while there is room); labels in 0 .. 3."""
    change, _ = CASES[case]
    edit(stopped / checkpoint.FILE, change, rewrite_record=True)
    refused_before_any_work(stopped, WRONG[case])


def test_results_whose_stages_contradict_the_position_are_refused(stopped: Path) -> None:
    edit(stopped / checkpoint.FILE, lambda s: s["results"]["rows"]["til"].clear(), rewrite_record=True)
    refused_before_any_work(stopped, r"its results hold 0 trained tasks where its position is at task 1")


def test_the_cli_refuses_a_damaged_checkpoint_in_one_paragraph_naming_the_file(stopped: Path) -> None:
    edit(stopped / checkpoint.FILE, CASES["held 0"][0], rewrite_record=False)
    before = snapshot(stopped)
    out = clbench(*TINY, *ER, "resume=true", f"hydra.run.dir={stopped}", cwd=stopped.parent)
    refused(out, f"Cannot resume: {stopped / checkpoint.FILE} does not match what was written", "held changed")
    assert snapshot(stopped) == before
