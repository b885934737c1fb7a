"""Each paper preset of the table (the prompt methods', the L2P table's L2P rows, HAT's, PackNet's, Piggyback's,
SupSup's, and the rows of the Protocol-P tables: APER's, SimpleCIL's, RanPAC's, MIN's, EASE's, MOS's, TUNA's) against
its official code (tests/oracles/official_presets.yaml: each key's official value, read from the code at a commit,
file and line): a key whose composed value differs from the official one must be named on a "# Departure keys:" line
of the preset or of a preset it extends (whose comment then says why and how to get the official value), and a key
named there must differ (no stale claims)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from clbench.config import config_dir
from clbench.paper_table import load_table
from conftest import compose_config

OFFICIAL = yaml.safe_load((Path(__file__).parent / "oracles" / "official_presets.yaml").read_text())
STATED = "# Departure keys:"


def stated(preset: str) -> set[str]:
    """The keys on the "# Departure keys:" lines of the preset and of the presets it extends."""
    text = (config_dir() / "experiment" / f"{preset}.yaml").read_text()
    lines = [line[len(STATED) :] for line in text.splitlines() if line.startswith(STATED)]
    keys = {key.strip() for line in lines for key in line.split(",") if key.strip()}
    for parent in re.findall(r"^\s*- /experiment/(\w+)", text, re.MULTILINE):
        keys |= stated(parent)
    return keys


@pytest.mark.parametrize("preset", sorted(OFFICIAL))
def test_a_paper_preset_states_each_key_where_it_departs_from_its_official_code(preset: str) -> None:
    values = OFFICIAL[preset]["values"]
    cfg = compose_config(f"experiment={preset}")
    got = {key: OmegaConf.select(cfg, key, throw_on_missing=True) for key in values}
    got = {key: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for key, v in got.items()}
    differs = {key for key, row in values.items() if got[key] != row["value"]}
    claimed = stated(preset)
    unstated = {
        key: f"{got[key]!r} (official: {values[key]['value']!r}, {values[key]['source']})" for key in differs - claimed
    }
    assert not unstated, f"{preset} departs from {OFFICIAL[preset]['code']} without saying so: {unstated}"
    assert claimed <= set(values), (
        f"{preset} states departures on keys the official table lacks: {claimed - set(values)}"
    )
    assert claimed <= differs, f"{preset} states departures where it has the official value: {claimed - differs}"


# Paper presets without an official configuration to hold them to, and why.
WITHOUT_OFFICIAL = {
    "meat_deit_small_paper": "MEAT's released code has no training script or config: the preset follows the paper's "
    "text and DeiT's recipe, each value sourced in its comment",
    "hat_paper_schedule": "a schedule added to any benchmark, not a paper's whole setting; hat_mixture_paper holds "
    "HAT's code to its values",
}


def test_every_paper_preset_is_held_to_its_official_code_or_says_why_not() -> None:
    presets = {p.stem for p in (config_dir() / "experiment").glob("*_paper*.yaml")}
    assert presets - set(OFFICIAL) == set(WITHOUT_OFFICIAL)
    for name in ("aper", "ranpac", "sdlora", "inflora", "min", "ease", "mos", "tuna"):  # the Protocol-P tables
        assert {row.preset for row in load_table(name).rows} - {None} <= set(OFFICIAL), name
