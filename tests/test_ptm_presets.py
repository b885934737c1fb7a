"""The Protocol-P presets of APER (every variant), SimpleCIL, RanPAC, MIN, SD-LoRA, InfLoRA, EASE and MOS (both
backbones), TUNA, and the tables of their published numbers (``clbench-report --table aper`` / ``ranpac`` / ``min`` /
``sdlora`` / ``inflora`` / ``ease`` / ``mos`` / ``tuna``): every row's preset exists, a glob sweeps exactly the
table's presets, each preset names a Protocol-P data config, and its method and recipe build and take the first
training step (on the embedded micro ViT and tiny data in place of the benchmark's: tests/test_preset_departures.py
holds each preset, benchmark and backbone included, to its official code's values)."""

from __future__ import annotations

import re
import statistics

import pytest
import torch

from clbench import paper_table
from clbench.config import config_dir, validate
from clbench.loop.runtime import build_runtime
from conftest import compose_config
from test_presets import first_step

CONF = config_dir()
PROTOCOL_P = {  # the pack's data configs, by their fixed names
    "cifar224_b0inc5",
    "cifar224_b0inc10",
    "imagenet_r_p_b0inc5",
    "imagenet_r_p_b0inc10",
    "imagenet_r_p_b0inc20",
    "imagenet_r_p_b0inc40",
    "imagenet_a_p_b0inc10",
    "imagenet_a_p_b0inc20",
    "cub_p_b0inc10",
    "cub_p_b0inc20",
    "objectnet_p_b0inc10",
    "objectnet_p_b0inc20",
    "omnibench_p_b0inc20",
    "omnibench_p_b0inc30",
    "vtab_p_b0inc10",
}
TABLES = {
    "aper": "[aper_*,simplecil_*]",
    "ranpac": "ranpac_*",
    "min": "min_*",
    "ease": "ease_*",
    "mos": "mos_*",
    "tuna": "tuna_*",
}
# In place of the benchmark and ViT-B/16: the embedded micro ViT (its shipped weights) on tiny synthetic tasks.
TINY_STAND_INS = (
    "data=synthetic_tiny",
    "data.synthetic_image_size=32",
    "backbone=vit_micro",
    "logger.mode=disabled",
)


def presets(table: str) -> list[str]:
    """The table's rows that have a preset (MIN's table also lists its paper's settings no official config covers)."""
    return [row.preset for row in paper_table.load_table(table).rows if row.preset is not None]


def test_every_row_has_its_preset_and_the_glob_sweeps_exactly_the_table() -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    parser = OverridesParser.create(config_loader=loader)
    for table, pattern in TABLES.items():
        rows = presets(table)
        assert all((CONF / "experiment" / f"{p}.yaml").is_file() for p in rows), table
        assert f"experiment=glob({pattern})" in paper_table.load_table(table).multirun
        (override,) = parser.parse_overrides([f"experiment=glob({pattern})"])
        assert sorted(override.sweep_string_iterator()) == sorted(rows), table
    assert len(presets("aper")) == 6 * 7 and len(presets("ranpac")) == 6 and len(presets("min")) == 2 * 4
    assert len(presets("ease")) == 2 * 7 and len(presets("mos")) == 2 * 7 and len(presets("tuna")) == 4


# MOS's presets differ in their recipe's values only, but for ImageNet-A's variance: that one in the default suite,
# the others in make test-all (the default suite's budget; tests/test_preset_departures.py holds every value).
MOS_DEFAULT = "mos_imagenet_a_p_b0inc20_in21k"


@pytest.mark.parametrize(
    "preset",
    [
        *presets("aper"),
        *presets("ranpac"),
        *presets("min"),
        *presets("ease"),
        *presets("tuna"),
        *(p if p == MOS_DEFAULT else pytest.param(p, marks=pytest.mark.slow) for p in presets("mos")),
    ],
)
def test_a_preset_names_its_protocol_p_benchmark_and_builds_its_method_and_recipe(preset: str) -> None:
    full = compose_config(f"experiment={preset}")
    assert full.data.name in PROTOCOL_P  # set by the preset or the one it extends
    # pixels in [0, 1] through PILOT's pipeline, as every one of the codes but MIN's (mean = std = 0.5, its transforms)
    own = preset.startswith("min_")
    assert full.backbone.pretrained and full.backbone.normalize == own
    assert (full.data.transforms, full.data.protocol) == (("clbench", "clbench") if own else ("pilot", "P"))
    cfg = validate(compose_config(f"experiment={preset}", *TINY_STAND_INS))
    if preset.startswith("simplecil"):
        return  # it has no training step
    if preset.startswith("ease"):  # the OmniBenchmark configs run the code's moni_adam (APER mode), the others EASE
        assert cfg.method.aper_mode == ("omnibench" in preset)
    if preset.startswith("mos"):  # the variance for ImageNet-A (ca_storage_efficient_method), 5 x batch samples
        assert cfg.method.alignment.covariance == ("diagonal" if "imagenet_a" in preset else "full")
        assert cfg.method.alignment.samples_per_class == cfg.method.alignment.batch_size == 5 * cfg.trainer.batch_size
    if preset.startswith("tuna"):  # the code's path, which produced the logged numbers
        m = cfg.method
        assert (m.universal, m.freeze_old_adapters, m.alignment.cosine_epochs) == ("last", False, 5)
    adam = preset == "ease_objectnet_p_b0inc10_in1k"  # exps/ease_obj.json: optimizer adam
    assert cfg.trainer.optimizer == ("adam" if adam else "sgd") and cfg.trainer.min_lr == 0.0
    assert adam or cfg.trainer.momentum == 0.9
    method, rt = build_runtime(cfg)
    assert torch.isfinite(first_step(method, rt))


def test_the_tables_read_protocol_ps_micro_metrics_for_aper_and_the_per_task_mean_for_ranpac() -> None:
    """APER's logs report top-1 over all seen test images (Ā and A_T, micro); RanPAC's tables the final mean of
    per-task accuracies (clbench's macro final accuracy)."""
    aper, ranpac = paper_table.load_table("aper"), paper_table.load_table("ranpac")
    assert [c.reads for c in aper.columns] == ["metrics.cil.avg_incremental_acc_micro", "metrics.cil.final_acc_micro"]
    assert [c.reads for c in ranpac.columns] == ["metrics.cil.final_acc"]
    (row,) = [r for r in aper.rows if r.preset == "aper_adapter_cifar224_b0inc5"]
    assert row.published == {"avg_acc": (90.61, None), "last_acc": (85.14, None)}
    (row,) = [r for r in ranpac.rows if r.preset == "ranpac_imagenet_r_p_b0inc20"]
    assert row.published == {"final_acc": (77.9, None)}


def test_mins_table_sets_the_code_beside_its_logs_and_the_papers_method_beside_the_papers_numbers() -> None:
    """Protocol P's micro Ā and A_T, as the paper and the logs report them; per benchmark of the official configs the
    code's path beside its log and the paper's method beside Tables 1-3 (mean ± std of 3 runs); the 20- and 50-step
    settings, ImageNet-A and FOOD-101 listed without a preset."""
    table = paper_table.load_table("min")
    assert [c.reads for c in table.columns] == ["metrics.cil.avg_incremental_acc_micro", "metrics.cil.final_acc_micro"]
    rows = {r.preset: r for r in table.rows if r.preset}
    assert rows["min_cifar224_b0inc10"].published == {"avg_acc": (95.12, 0.05), "last_acc": (92.12, 0.16)}
    assert rows["min_cifar224_b0inc10_official"].published == {"avg_acc": (95.04, None), "last_acc": (91.88, None)}
    assert rows["min_imagenet_r_p_b0inc20"].published == {"avg_acc": (85.18, 0.19), "last_acc": (79.75, 0.07)}
    assert rows["min_omnibench_p_b0inc30"].published == {"avg_acc": (87.36, 0.04), "last_acc": (80.55, 0.10)}
    assert len(table.rows) == 6 * 3 + 5 and sum(r.preset is None for r in table.rows) == 23 - 8


LORA_TABLES = {"sdlora": "sdlora_*", "inflora": "inflora_*"}


def lora_presets() -> list[str]:
    return [row.preset for table in LORA_TABLES for row in paper_table.load_table(table).rows if row.preset]


def test_the_lora_tables_are_the_repositories_numbers_and_their_presets_sweep_as_one() -> None:
    """SD-LoRA's (the paper's Tables 2-3 as its repository shows them, mean and std; CIFAR-100 its log) and InfLoRA's
    (its seed-1993 logs: A_T the last of the top-1 curve, Ā its mean) in Protocol P's micro metrics; each glob runs
    exactly the rows with a preset."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(
        config_loader=ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    )
    for name, pattern in LORA_TABLES.items():
        table = paper_table.load_table(name)
        assert [c.reads for c in table.columns] == [
            "metrics.cil.final_acc_micro",
            "metrics.cil.avg_incremental_acc_micro",
        ]
        rows = [r.preset for r in table.rows if r.preset]
        (override,) = parser.parse_overrides([f"experiment=glob({pattern})"])
        assert sorted(override.sweep_string_iterator()) == sorted(rows), name
    sdlora = {r.preset: r.published for r in paper_table.load_table("sdlora").rows}
    assert sdlora["sdlora_imagenet_r_p_b0inc20"] == {"last_acc": (77.34, 0.35), "avg_acc": (82.04, 0.24)}
    assert sdlora["sdlora_cifar224_b0inc10"] == {"last_acc": (87.26, None), "avg_acc": (92.05, None)}
    cifar = [  # cifar100 .../0.log: the top1 curves of the official config's runs, seeds 0-4 (shuffle false)
        [99.4, 96.55, 94.47, 92.1, 90.98, 89.05, 88.31, 87.76, 87.93, 86.34],
        [99.6, 96.35, 94.7, 91.85, 90.3, 87.83, 86.9, 86.1, 86.42, 84.92],
        [99.3, 95.1, 93.67, 92.12, 91.38, 89.38, 88.63, 88.11, 88.3, 86.88],
        [99.1, 96.25, 94.53, 92.98, 91.72, 89.23, 88.46, 88.02, 88.09, 86.82],
        [99.4, 95.9, 93.73, 92.45, 91.66, 88.97, 88.46, 88.21, 87.8, 86.67],
    ]
    (row,) = [r for r in paper_table.load_table("inflora").rows if r.preset == "inflora_cifar224_b0inc10"]
    for key, runs in (("last_acc", [c[-1] for c in cifar]), ("avg_acc", [sum(c) / 10 for c in cifar])):
        assert row.published[key] == (
            pytest.approx(statistics.mean(runs), abs=5e-3),
            pytest.approx(statistics.stdev(runs), abs=5e-3),
        )


@pytest.mark.parametrize("preset", lora_presets())
def test_a_lora_preset_names_its_protocol_p_benchmark_and_the_official_path(preset: str) -> None:
    """SD-LoRA's presets run the code's path (magnitudes reset each task) the logged numbers came from; InfLoRA's the
    code's (the second pass grows the subspace); both build and take a training step."""
    text = (CONF / "experiment" / f"{preset}.yaml").read_text()
    (data,) = re.findall(r"^\s*- override /data: (\w+)", text, re.MULTILINE)
    assert data in PROTOCOL_P
    cfg = validate(compose_config(f"experiment={preset}", *TINY_STAND_INS))
    assert cfg.backbone.pretrained  # its input scaling: tests/test_preset_departures.py, on the real backbone
    if preset.startswith("sdlora"):
        assert (
            cfg.method.alpha_carry == "reset" and cfg.trainer.optimizer == "sgd" and cfg.trainer.schedule == "constant"
        )
    else:
        assert cfg.method.subspace_pass == "after" and cfg.trainer.optimizer == "adam"
    method, rt = build_runtime(cfg)
    assert torch.isfinite(first_step(method, rt))


def test_the_ease_table_reads_protocol_ps_micro_metrics_and_labels_its_aper_mode_rows() -> None:
    """EASE's logs report Ā and A_T (micro) for both backbones; the OmniBenchmark configs run the code's moni_adam,
    APER with an adapter: their rows say so (that their presets run that mode is checked preset by preset above)."""
    ease = paper_table.load_table("ease")
    assert [c.reads for c in ease.columns] == ["metrics.cil.avg_incremental_acc_micro", "metrics.cil.final_acc_micro"]
    (row,) = [r for r in ease.rows if r.preset == "ease_cifar224_b0inc5_in21k"]
    assert row.published == {"avg_acc": (91.51, None), "last_acc": (85.8, None)}
    for row in ease.rows:
        assert ("omnibench" in row.preset) == ("APER mode" in row.label), row.preset


def test_the_tuna_table_is_its_logs_last_and_mean_top1() -> None:
    """TUNA's logs (seed 1993): A_T the last of the "CNN top1 curve", Ā its mean ("Average Accuracy (CNN)")."""
    table = paper_table.load_table("tuna")
    assert [c.reads for c in table.columns] == ["metrics.cil.avg_incremental_acc_micro", "metrics.cil.final_acc_micro"]
    curve = [84.57, 81.39, 80.04, 76.65, 74.08, 73.23, 70.47, 66.75, 65.88, 64.78]  # imageneta/0/20 top1 curve
    (row,) = [r for r in table.rows if r.preset == "tuna_imagenet_a_p_b0inc20"]
    assert row.published == {"avg_acc": (pytest.approx(sum(curve) / 10, abs=5e-3), None), "last_acc": (curve[-1], None)}
