"""`make bench`: each entry is measured with the real training step and reported in bench.json's shape."""

from __future__ import annotations

import pytest

from clbench.bench import measure, parse

KEYS = {"name", "backbone", "batch_size", "image_size", "images_per_s", "step_ms", "peak_mem_mb", "mfu"}


@pytest.mark.parametrize("name", ["meat", "reference/timm_train", "reference/timm_frozen"])
def test_an_entry_is_measured_in_the_contract_shape(name: str) -> None:
    args = parse(["--batch-size", "4", "--image-size", "16", "--warmup", "1", "--steps", "1", "--repeats", "2"])
    entry = measure(args, name)
    assert set(entry) == KEYS and entry["name"] == name and entry["backbone"] == "vit_micro"
    assert entry["step_ms"] > 0 and entry["images_per_s"] > 0 and entry["peak_mem_mb"] > 0
    assert entry["mfu"] is None  # CPU: no FLOP peak to compare with


def test_unknown_entries_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse(["--methods", "magic"])
