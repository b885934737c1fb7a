"""The seed papers' tables (L2P Table 1, MEAT Table 1) as presets (conf/experiment/<table>_<row>.yaml) and as a report
(`clbench-report --table NAME`) beside their published numbers (clbench/tables/<table>.yaml).

Rows whose method (or the rehearsal memory) is not in clbench yet are expected to fail to compose until it lands
(xfail, strict); from then on they run as every other row and must pass."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from clbench import paper_table
from clbench.backbones.timm_vit import build_backbone
from clbench.comparable import setting
from clbench.config import BackboneConfig, config_dir, full_config, validate
from clbench.loop import train
from clbench.loop.runtime import build_runtime
from clbench.report import main as report_main
from conftest import compose_config, tiny_config
from test_data import write_cifar100
from test_folders import write_image_folder
from test_presets import NATURAL, SHRINK, first_step

CONF = config_dir()
# Each row's method, and for the rehearsal rows the memory: (images a class | a total, value).
L2P_ROWS: dict[str, tuple[str, tuple[str, int] | None]] = {
    "ft_seq_frozen": ("finetune", None),
    "ft_seq": ("finetune", None),
    "ewc": ("ewc", None),
    "lwf": ("lwf", None),
    "l2p": ("l2p", None),
    "er_10": ("er", ("size", 1000)),
    "gdumb_10": ("gdumb", ("size", 1000)),
    "bic_10": ("bic", ("size", 1000)),
    "derpp_10": ("derpp", ("size", 1000)),
    "l2p_r_10": ("l2p", ("per_class", 10)),
    "er_50": ("er", ("size", 5000)),
    "gdumb_50": ("gdumb", ("size", 5000)),
    "bic_50": ("bic", ("size", 5000)),
    "derpp_50": ("derpp", ("size", 5000)),
    "l2p_r_50": ("l2p", ("per_class", 50)),
    "upper_bound": ("joint", None),
}
FROZEN = {"ft_seq_frozen", "l2p", "l2p_r_10", "l2p_r_50"}  # L2P's Adam; the rest SGD momentum 0.9
MEAT_ROWS = {
    "individual": "individual",
    "classifier": "classifier",
    "lwf": "lwf",
    "piggyback": "piggyback",
    "hat": "hat",
    "adapter": "adapter",
    "meat": "meat",
}


def target(method: str) -> str:
    """The ``_target_`` of conf/method/<method>.yaml (classifier is finetune's class: the name is the config's)."""
    return yaml.safe_load((CONF / "method" / f"{method}.yaml").read_text())["method"]["_target_"]


def missing(method: str, memory: bool = False) -> list[str]:
    """What a row needs that clbench does not have yet: its method config, the memory config group."""
    out = [] if (CONF / "method" / f"{method}.yaml").is_file() else [f"method={method}"]
    return out + ([] if not memory or (CONF / "memory").is_dir() else ["the memory config group"])


def until_it_lands(preset: str, method: str, memory: bool = False) -> Any:
    """The row as a parameter, expected to fail (strictly) while what it needs is missing, run as usual after."""
    lacking = missing(method, memory)
    mark = pytest.mark.xfail(bool(lacking), reason=f"needs {', '.join(lacking)}", strict=True)
    return pytest.param(preset, marks=mark, id=preset)


def test_every_row_has_its_preset_and_glob_sweeps_exactly_the_table() -> None:
    """Each table row's preset file exists, and `experiment=glob(<table>_*)` (Hydra's multirun) expands to the
    table's presets, none more (the shared recipe file <table>.yaml is not a row)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # aper, ranpac, slca, sdlora, inflora, min, ease, mos and tuna (the Protocol-P tables): tests/test_ptm_presets.py;
    # hide: tests/test_hide.py
    known = [
        "aper",
        "ease",
        "hide",
        "inflora",
        "l2p_table1",
        "meat_table1",
        "min",
        "mos",
        "ranpac",
        "sdlora",
        "slca",
        "tuna",
    ]
    assert paper_table.known_tables() == known
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    parser = OverridesParser.create(config_loader=loader)
    for name, rows in (("l2p_table1", L2P_ROWS), ("meat_table1", MEAT_ROWS)):
        table = paper_table.load_table(name)
        presets = [r.preset for r in table.rows if r.preset]
        assert sorted(presets) == sorted(f"{name}_{r}" for r in rows)
        assert all((CONF / "experiment" / f"{p}.yaml").is_file() for p in presets)
        (override,) = parser.parse_overrides([f"experiment=glob({name}_*)"])
        assert sorted(override.sweep_string_iterator()) == sorted(presets)
    l2p = paper_table.load_table("l2p_table1")
    assert [r.label for r in l2p.rows][:5] == ["FT-seq-frozen", "FT-seq", "EWC", "LwF", "L2P"]
    assert [r.preset for r in l2p.rows if r.label == "Co2L"] == [None, None]  # published, no preset
    (r50,) = [r for r in l2p.rows if r.label == "L2P-R" and r.buffer == "50/class"]
    assert r50.published == {"avg_acc": (86.31, 0.59), "forgetting": (5.83, 0.61)}
    meat = paper_table.load_table("meat_table1")
    (adaptor,) = [r for r in meat.rows if r.label == "Adaptor-BERT"]
    assert adaptor.published["cub"] == (77.20, None) and adaptor.published["model_size_mb"] == (99.0, None)


def test_the_slca_table_is_the_repositorys_figure_and_its_presets_sweep_as_one() -> None:
    """SLCA's published numbers (the official repository's figure, A_T only) in Protocol P's micro metrics; every row
    with a preset has its file, and `experiment=glob(slca_*)` runs exactly those."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    table = paper_table.load_table("slca")
    assert [c.reads for c in table.columns] == ["metrics.cil.final_acc_micro", "metrics.cil.avg_incremental_acc_micro"]
    assert [r.published["last_acc"] for r in table.rows] == [(91.53, None), (77.0, None), (73.01, None), (66.04, None)]
    assert all(r.published["avg_acc"] is None for r in table.rows)
    presets = [r.preset for r in table.rows if r.preset]
    assert presets == ["slca_cifar224_b0inc10", "slca_imagenet_r_p_b0inc20", "slca_cub_p_b0inc20"]
    assert all((CONF / "experiment" / f"{p}.yaml").is_file() for p in presets)
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    (override,) = OverridesParser.create(config_loader=loader).parse_overrides(["experiment=glob(slca_*)"])
    assert sorted(override.sweep_string_iterator()) == sorted(presets)


@pytest.mark.parametrize(
    "row", [until_it_lands(f"l2p_table1_{r}", m, memory is not None) for r, (m, memory) in L2P_ROWS.items()]
)
def test_each_l2p_row_composes_with_the_papers_setting(row: str) -> None:
    name = row.removeprefix("l2p_table1_")
    method, memory = L2P_ROWS[name]
    composed = compose_config(f"experiment={row}")
    cfg = validate(composed)
    assert cfg.method_target == target(method)
    b, d, t = cfg.backbone, cfg.data, cfg.trainer
    assert (b.model, b.tag, b.pretrained, b.normalize, b.img_size) == (
        "vit_base_patch16_224",
        "orig_in21k",
        True,
        False,
        224,
    )
    assert (d.source, d.tasks, d.class_order_seed, d.test_resize) == ("cifar100", 10, None, 256)
    assert (t.batch_size, t.epochs, t.lr, t.lr_scale_batch, t.schedule, t.grad_clip) == (
        128,
        5,
        0.03,
        256,
        "constant",
        1.0,
    )
    assert t.optimizer == ("adam" if name in FROZEN else "sgd") and t.weight_decay == 0.0
    if t.optimizer == "sgd":
        assert t.momentum == 0.9
    if memory is not None:
        key, value = memory
        assert composed.memory[key] == value and composed.memory["size" if key == "per_class" else "per_class"] is None
    if method == "lwf":
        assert cfg.method.scope == "cil"
    if method == "finetune":
        assert cfg.method.loss_scope == "task" and cfg.method.freeze_backbone == (name == "ft_seq_frozen")


@pytest.mark.parametrize("row", [until_it_lands(f"meat_table1_{r}", m) for r, m in MEAT_ROWS.items()])
def test_each_meat_row_composes_with_the_papers_setting(row: str) -> None:
    name = row.removeprefix("meat_table1_")
    cfg = validate(compose_config(f"experiment={row}"))
    assert cfg.method_target == target(MEAT_ROWS[name])
    b, d, t = cfg.backbone, cfg.data, cfg.trainer
    assert (b.model, b.tag, b.pretrained, b.drop_path_rate) == ("deit_small_patch16_224", "fb_in1k", True, 0.1)
    assert d.datasets == ["cub200", "stanford_cars", "fgvc_aircraft", "wikiart", "sketches", "cifar100"]
    assert (t.batch_size, t.epochs, t.schedule, t.warmup_epochs, t.mixup, t.cutmix) == (256, 30, "cosine", 5, 0.8, 1.0)
    own = {"piggyback": ("adam", 1e-4, None), "hat": ("sgd", 0.05, None), "adapter": ("adamw_bert", 5e-4, 1024)}
    assert (t.optimizer, t.lr, t.lr_scale_batch) == own.get(name, ("adamw", 5e-4, 1024))
    if name == "adapter":  # adapter-bert's optimizer, weight decay, clipping and head
        assert (cfg.method.bottleneck, t.weight_decay, t.grad_clip, cfg.method.head_init) == (24, 0.01, 1.0, "bert")


@pytest.mark.parametrize(
    ("row", "paper"), [("l2p_table1_l2p", "l2p_cifar100_paper"), ("meat_table1_meat", "meat_deit_small_paper")]
)
def test_the_papers_own_rows_are_the_existing_paper_presets(row: str, paper: str) -> None:
    def as_setting(name: str) -> dict[str, Any]:
        return setting(full_config(validate(compose_config(f"experiment={name}"))))

    assert as_setting(row) == as_setting(paper)


@pytest.mark.parametrize(
    "row",
    [pytest.param("l2p_table1_ft_seq", marks=pytest.mark.slow), until_it_lands("l2p_table1_er_10", "er", memory=True)],
)
def test_an_l2p_row_takes_a_step_on_the_real_cifar100_layout(tmp_path: Path, row: str) -> None:
    write_cifar100(tmp_path)
    cfg = validate(compose_config(f"experiment={row}", f"data.root={tmp_path}", "data.verify_checksums=false", *SHRINK))
    method, rt = build_runtime(cfg)
    assert [list(t.classes) for t in rt.benchmark.tasks] == NATURAL
    assert torch.isfinite(first_step(method, rt))
    assert rt.test_tf(rt.benchmark.test[0].x[:2]).shape == (2, 3, 224, 224)


@pytest.mark.slow  # 10 s: six datasets written and decoded at 224 px
def test_a_meat_row_with_its_own_optimizer_takes_a_step_on_its_datasets(tmp_path: Path) -> None:
    """HAT under MEAT's DeiT recipe (mixup / cutmix soft targets, RandAugment) with HAT's SGD."""
    for name in ("cub200", "stanford_cars", "fgvc_aircraft", "wikiart", "sketches"):
        write_image_folder(tmp_path / name, ["a", "b"], 2, split=True)
    write_cifar100(tmp_path, per_class=1)
    overrides = ("experiment=meat_table1_hat", f"data.root={tmp_path}", "data.verify_checksums=false")
    cfg = validate(compose_config(*overrides, "data.store_size=32", *SHRINK))
    method, rt = build_runtime(cfg)
    assert torch.isfinite(first_step(method, rt))


# ------------------------------------------------------------------------------------------------------- the report
def job(sweep: Path, number: int, overrides: list[str], results: dict[str, Any] | None = None) -> Path:
    """A Hydra multirun job folder: <sweep>/<number>/.hydra/overrides.yaml, and results.json when given."""
    folder = sweep / str(number)
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if results is not None:
        (folder / "results.json").write_text(json.dumps(results))
    return folder


def table_rows(text: str) -> list[dict[str, str]]:
    lines = [line.strip().strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    head = [h.strip() for h in lines[0]]
    return [dict(zip(head, [c.strip() for c in cells], strict=True)) for cells in lines[1:]]


def test_the_l2p_table_report_lays_runs_out_in_the_papers_order_beside_its_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Finetune and joint (the tiny setting) with two seeds each, laid out as a multirun of the table (FT-seq and
    Upper-bound), plus a run of another preset and one of a row with an extra setting: both listed apart."""
    sweep, runs = tmp_path / "multirun", {}
    for number, (preset, method, seed) in enumerate(
        [("ft_seq", "finetune", 0), ("ft_seq", "finetune", 1), ("upper_bound", "joint", 0), ("upper_bound", "joint", 1)]
    ):
        folder = job(sweep, number, [f"experiment=l2p_table1_{preset}", f"seed={seed}"])
        extra = ("method.loss_scope=task",) if method == "finetune" else ()
        train(
            tiny_config(
                f"method={method}",
                f"seed={seed}",
                "trainer.epochs=1",
                "data.num_tasks=2",
                "trainer.eval_random_init=false",
                *extra,
            ),
            folder,
        )
        runs.setdefault(preset, []).append(json.loads((folder / "results.json").read_text()))
    other = json.loads((sweep / "0" / "results.json").read_text())
    other["seed"] = other["config"]["seed"] = 7  # not a duplicate of seed 0
    job(sweep, 4, ["experiment=l2p_cifar100_paper", "seed=7"], other)
    other["seed"] = other["config"]["seed"] = 8
    job(sweep, 5, ["experiment=l2p_table1_ft_seq", "seed=8", "trainer.lr=0.1", "logger.mode=offline"], other)

    report_main(["--table", "l2p_table1", str(sweep), "--out", str(tmp_path / "table")])
    out = capsys.readouterr().out
    assert out == (tmp_path / "table.md").read_text()
    rows = table_rows(out)
    table = paper_table.load_table("l2p_table1")
    assert [r["Method"] for r in rows] == [r.label for r in table.rows]
    assert [r["Buffer"] for r in rows][4:7] == ["0", "10/class", "10/class"]
    by_preset = {r["Preset"]: r for r in rows}
    for preset, label, paper in (
        ("ft_seq", "FT-seq", (33.61, 0.85, 86.87, 0.20)),
        ("upper_bound", "Upper-bound", None),
    ):
        row = by_preset[f"l2p_table1_{preset}"]
        acc = [r["metrics"]["cil"]["final_acc"] for r in runs[preset]]
        assert row["Method"] == label and row["runs"] == "2"
        assert row["Avg Acc clbench"] == f"{statistics.fmean(acc):.2f} ± {statistics.stdev(acc):.2f}"
        if paper:
            forgetting = [r["metrics"]["cil"]["forgetting_l2p"] for r in runs[preset]]
            assert (
                row["Forgetting clbench"] == f"{statistics.fmean(forgetting):.2f} ± {statistics.stdev(forgetting):.2f}"
            )
            assert row["Avg Acc paper"] == "33.61 ± 0.85" and row["Forgetting paper"] == "86.87 ± 0.20"
            assert row["Avg Acc Δ"] == f"{statistics.fmean(acc) - 33.61:+.2f}"
            assert row["Forgetting Δ"] == f"{statistics.fmean(forgetting) - 86.87:+.2f}"
        else:  # the paper prints "–" for the upper bound's forgetting: no difference
            assert (
                row["Avg Acc paper"] == "90.85 ± 0.12" and row["Forgetting paper"] == "–" and row["Forgetting Δ"] == ""
            )
    er = by_preset["l2p_table1_er_10"]
    assert er["runs"] == er["Avg Acc clbench"] == er["Avg Acc Δ"] == "" and er["Avg Acc paper"] == "67.87 ± 0.57"
    assert by_preset["(no preset)"]["Method"] == "Co2L"
    apart = out.split("Not rows of this table")[1]
    assert f"{sweep / '4'}: not a row of l2p_table1 (experiment=l2p_cifar100_paper)" in apart
    assert f"{sweep / '5'}: row preset l2p_table1_ft_seq with other settings: trainer.lr=0.1" in apart
    assert "logger.mode" not in apart

    (ft,) = [r for r in csv.DictReader((tmp_path / "table.csv").open()) if r["preset"] == "l2p_table1_ft_seq"]
    acc = [r["metrics"]["cil"]["final_acc"] for r in runs["ft_seq"]]
    assert float(ft["avg_acc_mean"]) == pytest.approx(statistics.fmean(acc), abs=1e-4)
    assert float(ft["avg_acc_diff"]) == pytest.approx(statistics.fmean(acc) - 33.61, abs=1e-4)
    assert ft["avg_acc_paper"] == "33.6100" and ft["reconstructed"] == "False"
    tex = (tmp_path / "table.tex").read_text()
    assert r"\toprule" in tex and "FT-seq-frozen" in tex and r"$\pm$" in tex and "DER++" in tex


def test_an_unknown_table_lists_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        report_main(["--table", "l2p_tabel1", str(tmp_path)])
    assert exit_.value.code == 2
    known = "Known tables: aper, ease, hide, inflora, l2p_table1, meat_table1, min, mos, ranpac, sdlora"
    assert known in capsys.readouterr().err


def test_the_meat_table_reads_each_datasets_final_til_accuracy_and_the_stored_size(tmp_path: Path) -> None:
    """Per dataset, the last TIL row at the task whose classes come from it; model size = fp32 backbone + every stored
    bit; ImageNet unmeasured (n/m); a reconstructed method's row is marked."""
    datasets = ["cub200", "stanford_cars", "fgvc_aircraft", "wikiart", "sketches", "cifar100"]
    backbone = {
        "model": "vit_tiny_patch16_224",
        "img_size": 32,
        "kwargs": {"patch_size": 4, "embed_dim": 64, "depth": 1, "num_heads": 4},
    }
    params = paper_table.backbone_params(backbone)
    assert params == sum(p.numel() for p in build_backbone(BackboneConfig(name="m", **backbone)).parameters())
    runs = []
    for seed in (0, 1):
        final = [70.0 + i + seed for i in range(6)]
        run = {
            "config": {"backbone": backbone, "seed": seed, "method": {"_target_": "x.Y"}},
            "reconstructed": True,
            "tasks": [{"class_names": [f"{d}/a", f"{d}/b"]} for d in reversed(datasets)],  # the order is the names'
            "acc_matrix": {"til": [final[::-1]]},
            "storage": {"bits_per_task": [{"head": 8_000_000, "masks": 16_000_000}] * 6, "shared_bits": {"keys": 8e6}},
            "_folder": str(job(tmp_path, seed, ["experiment=meat_table1_meat", f"seed={seed}"])),
        }
        runs.append(run)
    md = paper_table.report("meat_table1", runs, [])[".md"]
    (meat,) = [r for r in table_rows(md) if r["Preset"] == "meat_table1_meat"]
    assert meat["Method"] == "MEAT †" and "reconstructed method" in md
    assert meat["CUB clbench"] == f"70.50 ± {statistics.stdev([70, 71]):.2f}" and meat["CUB paper"] == "81.53"
    assert meat["CIFAR-100 clbench"].startswith("75.50") and meat["CUB Δ"] == f"{70.5 - 81.53:+.2f}"
    assert meat["ImageNet clbench"] == "n/m" and meat["ImageNet paper"] == "79.84"
    size = (32 * params + 6 * 24_000_000 + 8_000_000) / 8 / 1e6
    assert meat["Model size (MB) clbench"] == f"{size:.2f} ± 0.00" and meat["Model size (MB) paper"] == "96.00"
    (hat,) = [r for r in table_rows(md) if r["Method"] == "HAT"]
    assert hat["ImageNet paper"] == "–" and hat["runs"] == ""


PILOT_TABLE = """
name: pilot_demo
title: "A Protocol-P table: Abar and A_T"
citation: a test's numbers
multirun: "clbench -m experiment=simplecil_cub_p_b0inc10 seed=0,1"
metrics:
  - {key: abar, label: Abar, reads: metrics.cil.avg_incremental_acc_micro}
  - {key: last, label: A_T, reads: metrics.cil.final_acc_micro}
rows:
  - {label: SimpleCIL, preset: simplecil_cub_p_b0inc10, published: {abar: [85.0], last: [80.0]}}
"""


def test_a_table_can_lay_out_protocol_ps_micro_metrics_and_refuses_a_name_results_json_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "pilot_demo.yaml").write_text(PILOT_TABLE)
    monkeypatch.setattr(paper_table, "TABLES", tables)
    from clbench.metrics import summary

    config = {"method": {"_target_": "clbench.methods.simplecil.SimpleCIL"}, "data": {"name": "cub_p_b0inc10"}}
    for seed, (abar, last) in enumerate(((86.0, 81.0), (88.0, 83.0))):
        # tasks of 1 and 3 test images: A_0 = R[0][0], A_1 = (R[1][0] + 3 R[1][1]) / 4 = last, Abar = (A_0 + A_1) / 2
        matrix = [[2 * abar - last, None], [last, last]]
        tasks = [{"id": t, "classes": [t], "class_names": [str(t)], "test_images": n} for t, n in ((0, 1), (1, 3))]
        metrics = {s: summary(matrix, [None, None], None, [1, 3]) for s in ("til", "cil")}
        run = {"method": "simplecil", "backbone": "b", "benchmark": "cub_p_b0inc10", "seed": seed,
               "status": "finished", "config": {**config, "seed": seed}, "tasks": tasks,
               "acc_matrix": {"til": matrix, "cil": matrix}, "metrics": metrics}  # fmt: skip
        job(tmp_path / "sweep", seed, ["experiment=simplecil_cub_p_b0inc10", f"seed={seed}"], run)
    report_main(["--table", "pilot_demo", str(tmp_path / "sweep"), "--out", str(tmp_path / "table")])
    (row,) = table_rows(capsys.readouterr().out)
    assert (row["Abar clbench"], row["Abar paper"], row["Abar Δ"]) == ("87.00 ± 1.41", "85.00", "+2.00")
    assert (row["A_T clbench"], row["A_T paper"], row["A_T Δ"]) == ("82.00 ± 1.41", "80.00", "+2.00")
    (tables / "pilot_demo.yaml").write_text(PILOT_TABLE.replace("final_acc_micro", "final_acc_mikro"))
    with pytest.raises(ValueError, match=r"reads 'metrics\.cil\.final_acc_mikro': not metrics\.<til\|cil>\.<"):
        paper_table.load_table("pilot_demo")


def test_a_weights_file_is_the_rows_setting_when_its_hash_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`backbone.weights=PATH` (what the missing-weights message offers offline) loads the row's weights when the
    file's SHA-256 is theirs: the run is in the row, and the row says it was made with that override; a file with
    another hash is another setting, listed apart."""
    from test_report import write_run

    hub, other = "a" * 64, "b" * 64
    sweep = tmp_path / "sweep"
    jobs = [(None, hub), ("/offline/vit_in21k.npz", hub), ("/offline/vit_in1k.npz", other)]
    for seed, (path, sha) in enumerate([(None, hub), *jobs]):
        changes = {"backbone.weights": path, "backbone.pretrained": path is None}
        recorded = {"weights_file": path or "/hub/cache/model.safetensors", "weights_sha256": sha}
        write_run(sweep / str(seed), seed=seed, changes=changes, backbone_config=recorded)
        extra = [f"backbone.weights={path}"] if path else []
        job(sweep, seed, ["experiment=l2p_table1_er_10", f"seed={seed}", *extra])
    report_main(["--table", "l2p_table1", str(sweep), "--out", str(tmp_path / "table")])
    out = capsys.readouterr().out
    (row,) = [r for r in table_rows(out) if r["Preset"] == "l2p_table1_er_10"]
    assert row["runs"] == "3" and row["Method"] == "ER *"
    assert "ER (10/class): backbone.weights=/offline/vit_in21k.npz (SHA-256 aaaaaaaaaaaa...)" in out
    apart = out.split("Not rows of this table")[1]
    (line,) = [x for x in apart.splitlines() if x.startswith(f"- {sweep / '3'}:")]
    assert "a different setting from its 3 other runs (backbone.weights_sha256)" in line
    assert f"{sweep / '2'}" not in apart
