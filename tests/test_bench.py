"""`make bench`: each entry is measured with the real training step and reported in bench.json's shape."""

from __future__ import annotations

import signal
import sys

import pytest

from clbench.bench.cli import measure, parse
from clbench.methods import TRAINED
from conftest import attention_ops, baselines_slow

KEYS = {
    "name",
    "backbone",
    "batch_size",
    "image_size",
    "images_per_step",
    "images_per_s",
    "step_ms",
    "peak_mem_mb",
    "mfu",
}
TINY = ["--batch-size", "4", "--image-size", "16", "--warmup", "1", "--steps", "1", "--repeats", "2"]


@pytest.mark.parametrize("name", ["meat", "reference/timm_train", "reference/timm_frozen", "reference/timm_inference"])
def test_an_entry_is_measured_in_the_contract_shape(name: str) -> None:
    entry = measure(parse(TINY), name)
    assert set(entry) == {*KEYS, "gflops_per_step", "data_ms"} and entry["name"] == name
    assert entry["backbone"] == "vit_micro" and entry["gflops_per_step"] > 0
    assert entry["step_ms"] > 0 and entry["images_per_s"] > 0 and entry["peak_mem_mb"] > 0
    assert entry["mfu"] is None  # CPU: no FLOP peak to compare with
    assert (entry["data_ms"] is None) == name.startswith("reference/")  # a method's batch fetch + augmentation
    if entry["data_ms"] is not None:
        assert 0 < entry["data_ms"] < entry["step_ms"]


def test_the_cuda_path_runs_on_cpu_up_to_the_device_calls() -> None:
    """bf16 autocast, FLOP counting and the MFU formula run here as on a GPU; only the peak is given by hand."""
    entry = measure(parse([*TINY, "--precision", "bf16", "--peak-flops", "1e12"]), "finetune")
    assert entry["gflops_per_step"] > 0
    assert entry["mfu"] == pytest.approx(entry["gflops_per_step"] * 1e9 / (entry["step_ms"] / 1000) / 1e12, rel=0.05)


@pytest.mark.parametrize("name", ["magic", "magic_cil/T=2", "ease_cil/T=0", "ease_cil/T=x"])
def test_unknown_entries_are_refused(name: str) -> None:
    with pytest.raises(SystemExit):
        parse(["--methods", name])


def test_any_methods_class_incremental_prediction_is_an_entry() -> None:
    """``<method>_cil/T=<k>``: the method's CIL prediction of one batch after k tasks, in the contract's shape."""
    assert parse(["--methods", "ease_cil/T=3"]).methods == ["ease_cil/T=3"]
    entry = measure(parse(TINY), "ease_cil/T=3")
    assert set(entry) >= KEYS and entry["name"] == "ease_cil/T=3" and entry["step_ms"] > 0


def test_target_ratios_follow_their_definitions() -> None:
    from clbench.bench.cli import target_ratios

    ms = {"finetune": 50.0, "hat": 60.0, "meat": 75.0, "l2p": 90.0, "dualprompt": 99.0, "coda_prompt": 117.0}
    ms |= {"apd": 100.0, "tfm": 55.0}
    refs = {"reference/timm_train": 55.0, "reference/timm_compiled": 40.0}
    refs |= {"reference/timm_frozen": 40.0, "reference/timm_inference": 20.0}
    entries = [{"name": k, "step_ms": v, "images_per_step": 32} for k, v in {**ms, **refs}.items()]
    entries.append({"name": "er", "step_ms": 90.0, "images_per_step": 64})  # 32 current + 32 replayed images
    ratios = target_ratios(entries)
    assert ratios == {
        "finetune_speed_vs_timm_train": 1.1,
        "finetune_speed_vs_timm_compiled": 0.8,
        "slowest_method_step_vs_finetune": 1.5,
        "l2p_step_vs_frozen_plus_inference": 1.5,
        "slowest_prompt_successor_step_vs_l2p": 1.3,
        "slowest_survey_method_step_vs_finetune": 2.0,
        "slowest_baseline_per_image_vs_finetune": 0.9,  # (90 / 64) / (50 / 32)
    }
    assert target_ratios([{"name": "l2p", "error": "x"}])["l2p_step_vs_frozen_plus_inference"] is None


@pytest.mark.parametrize("name", baselines_slow([m for m in TRAINED if m != "joint"]))
def test_every_method_trains_with_fused_attention(name: str) -> None:
    """PyTorch's fused scaled-dot-product attention in every method's real step, no softmax of attention maps
    (cross-entropy's log-softmax aside): MEAT's token masks and L2P's prompts included."""
    from clbench.bench.models import method_step

    fused, softmax = attention_ops(method_step(parse(TINY), name).step)
    assert fused and not softmax, softmax


def test_the_median_round_is_kept() -> None:
    from clbench.bench.cli import median_round

    rounds = [{"name": "a", "step_ms": v} for v in (30.0, 10.0, 20.0)]
    assert median_round(rounds)["step_ms"] == 20.0
    assert median_round([{"name": "a", "error": "x"}, {"name": "a", "step_ms": 5.0}])["step_ms"] == 5.0
    assert "error" in median_round([{"name": "a", "error": "x"}])


def test_the_data_entries_time_the_stream_against_imagefolder(tmp_path) -> None:
    from clbench.bench.data import prepare

    args = parse([*TINY, "--workers", "0", "--data-images", "60", "--data-dir", str(tmp_path)])
    prepare(args)
    entries = {name: measure(args, name) for name in ("data/stream", "reference/imagefolder", "finetune/stream")}
    assert all(e["images_per_s"] > 0 and e["mfu"] is None for e in entries.values())
    assert entries["data/stream"]["gflops_per_step"] == 0  # a data entry: no model
    wait = entries["finetune/stream"]["data_ms"]  # the step's wait for its streamed batch, a part of the step
    assert wait is not None and 0 <= wait < entries["finetune/stream"]["step_ms"]
    assert list((tmp_path / "cache").glob("jpegs-*/train_x.npy"))  # streamed from the cache of the same JPEGs


def test_streaming_memory_stays_flat_while_the_device_store_grows(tmp_path, monkeypatch) -> None:
    """The memory entries with a 100-image unit: the held store's peak grows by the images it holds, the stream's
    not (it holds one batch)."""
    from clbench.bench import data as bench_data

    monkeypatch.setattr(bench_data, "TEST_SET", 2000)
    args = parse([*TINY, "--data-dir", str(tmp_path)])
    peak = {name: measure(args, name)["peak_mem_mb"] for name in ("data/stream_x10", "data/device_x10")}
    held = 10 * 2000 * 3 * 32 * 32 / 2**20  # MiB of images the device store keeps
    assert peak["data/device_x10"] - peak["data/stream_x10"] > 0.8 * held


def test_resume_keeps_what_was_measured_and_measures_the_rest(tmp_path) -> None:
    """bench.json is rewritten after every entry; ``--resume`` keeps its error-free entries measured with the same
    settings, re-measures the failed ones, and refuses a file measured otherwise; ``--time-limit`` stops before an
    entry would run past it, with what was measured written."""
    import json

    from clbench.bench.cli import main, settings

    out = tmp_path / "bench.json"
    argv = [*TINY, "--methods", "reference/timm_inference", "finetune", "--out", str(out), "--resume"]
    kept = dict.fromkeys(KEYS, 1.0) | {"name": "reference/timm_inference", "gflops_per_step": 1.0, "data_ms": None}
    failed = {"name": "finetune", "error": "RuntimeError: killed"}
    out.write_text(json.dumps({"settings": settings(parse(argv)), "results": [kept, failed]}))
    main(argv)
    report = json.loads(out.read_text())
    assert report["complete"] and report["settings"] == settings(parse(argv))
    first, second = report["results"]
    assert first == kept  # not measured again
    assert second["name"] == "finetune" and second["step_ms"] > 0 and second["wall_s"] >= 0
    out.write_text(json.dumps({"settings": settings(parse(argv)), "results": [kept]}))
    with pytest.raises(SystemExit) as stopped:  # no time left: nothing started, what was kept is written
        main([*argv, "--time-limit", "1e-9"])
    report = json.loads(out.read_text())
    assert stopped.value.code == 3 and not report["complete"] and report["results"] == [kept]
    with pytest.raises(SystemExit, match="was measured with"):
        main([*argv[: argv.index("--methods")], "--batch-size", "8", *argv[argv.index("--methods") :]])


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--steps", "-1"),
        ("--steps", "0"),
        ("--rounds", "0"),
        ("--rounds", "-2"),
        ("--repeats", "0"),
        ("--batch-size", "0"),
        ("--warmup", "-1"),
        ("--peak-flops", "inf"),
        ("--time-limit", "0"),
    ],
)
def test_counts_that_would_time_nothing_are_refused_by_argparse(flag: str, value: str, capsys) -> None:
    """A step count of -1 gave a "complete" bench.json of negative images/s; 0 a ZeroDivisionError."""
    with pytest.raises(SystemExit) as refused:
        parse([flag, value])
    assert refused.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys) -> None:
    for out in ("/proc/nope/bench.json", str(tmp_path)):
        with pytest.raises(SystemExit) as refused:
            parse(["--out", out])
        assert refused.value.code == 2 and "--out" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content",
    [
        b"\x89PNG\r\n\x1a\n\x00\xff\xfe",  # binary
        b"[1, 2, 3]",
        b'{"settings": {}, "results": [1, 2]}',
        b'{"settings": {}, "results": [{"step_ms": 1.0}]}',  # an entry without a name
        b"folder",
    ],
)
def test_resume_refuses_a_file_that_is_not_a_bench_report_before_measuring(tmp_path, content: bytes, capsys) -> None:
    from clbench.bench.cli import main

    out = tmp_path / "bench.json"
    if content == b"folder":
        out.mkdir()
    else:
        out.write_bytes(content)
    with pytest.raises(SystemExit) as refused:
        main([*TINY, "--methods", "finetune", "--out", str(out), "--resume"])
    said = f"{refused.value.code} {capsys.readouterr().err}"
    assert refused.value.code not in (0, None) and str(out) in said and "Traceback" not in said
    assert out.is_dir() or out.read_bytes() == content  # untouched: nothing was measured


def test_in_process_entries_are_measured_one_after_another_in_this_process(tmp_path) -> None:
    """``--in-process`` (a GPU window's bench): every entry measured here, in the contract's shape; the CPU's peak
    memory, the process's and not the entry's, left out rather than misreported."""
    import json

    from clbench.bench.cli import main

    out = tmp_path / "bench.json"
    main([*TINY, "--in-process", "--methods", "finetune", "reference/timm_train", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["complete"] and report["settings"]["in_process"] is True
    assert [r["name"] for r in report["results"]] == ["finetune", "reference/timm_train"]
    assert all(r["step_ms"] > 0 and r["peak_mem_mb"] is None for r in report["results"])


def test_the_windows_command_stops_a_part_at_its_share_and_keeps_what_it_wrote(tmp_path) -> None:
    """A part past its seconds gets SIGINT (pytest then writes the XML of what ran), and the window goes on; also when
    the window itself was started ignoring SIGINT (a shell's background job), which a part would otherwise inherit."""
    from clbench.bench.window import run_until

    script = "try:\n    import time\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('wound down')\n"
    for name, disposition in (("default", signal.default_int_handler), ("ignored", signal.SIG_IGN)):
        previous = signal.signal(signal.SIGINT, disposition)
        try:
            run = run_until([sys.executable, "-c", script], 2.0, tmp_path / f"{name}.log")
        finally:
            signal.signal(signal.SIGINT, previous)
        assert run["stopped"] and run["returncode"] == 0 and run["wall_s"] < 30, name
        assert (tmp_path / f"{name}.log").read_text().strip() == "wound down", name


def test_the_smoke_report_counts_passes_failures_and_skips(tmp_path) -> None:
    from clbench.bench.window import junit_outcomes

    xml = tmp_path / "smoke.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="test_gpu" name="test_a[meat]" time="1.0"/>'
        '<testcase classname="test_gpu" name="test_a[hat]" time="1.0"><failure message="sync">tb</failure></testcase>'
        '<testcase classname="test_gpu" name="test_b[hat]" time="0.1"><error message="setup">tb</error></testcase>'
        '<testcase classname="test_gpu" name="test_c" time="0"><skipped message="no cuda"/></testcase>'
        "</testsuite></testsuites>"
    )
    outcomes = junit_outcomes(xml)
    assert outcomes["passed"] == 1 and outcomes["skipped"] == 1
    assert outcomes["failed"] == [
        {"test": "test_a[hat]", "message": "sync"},
        {"test": "test_b[hat]", "message": "setup"},
    ]
    assert junit_outcomes(tmp_path / "none.xml")["report"] is None  # killed before it wrote anything
