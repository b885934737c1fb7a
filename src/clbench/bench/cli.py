"""`make bench` / `python -m clbench.bench`: training-step throughput of every method against plain timm references
(:mod:`clbench.bench.models`) and of the data path (:mod:`clbench.bench.data`).

Every figure is the median over ``--repeats`` timings of ``--steps`` steps after ``--warmup`` steps. Each entry
runs in its own process, so its peak memory is its own (CUDA: max allocated; CPU: max resident set size).
``--rounds K`` measures the whole list K times, interleaved, and keeps each entry's median round, so that drift
of a shared machine affects every entry alike (ratios between entries are then trustworthy). ``--in-process``
measures every entry in this one process instead (no start-up per entry: a short GPU window fits more of them):
each entry's CUDA peak is reset before it and its memory freed after it, and a compiled entry starts from fresh
dynamo caches as every phase of a run does (the on-disk inductor cache serves the kernels entries share); the CPU's
peak memory is the process's, so it is left out.
FLOPs of one step are counted with torch's FlopCounterMode on the eager step on every device; model-FLOP
utilisation = FLOPs / step time / the device's dense bf16 peak (from a table of GPUs, or ``--peak-flops``), null
where no peak is known (CPU). A method's ``data_ms`` is the part of its step spent fetching the batch and augmenting
it on the device. Methods step as a run would (``--compile``, ``--cuda-graphs``: auto, as ``trainer.*``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clbench.bench import data as bench_data
from clbench.bench.models import (
    INFERENCE,
    METHODS,
    PROMPTS,
    REFERENCES,
    SURVEY,
    inference_entry,
    inference_step,
    method_step,
    reference_step,
)
from clbench.bench.timing import Waits, peak_flops, step_flops, timed
from clbench.errors import ConfigError
from clbench.files import check_writable
from clbench.methods import BASELINES


def measure(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One entry, measured in this process (run in a fresh one by :func:`main`)."""
    torch.manual_seed(0)
    if name in bench_data.ENTRIES:
        build = bench_data.build
    else:
        build = reference_step if name in REFERENCES else inference_step if inference_entry(name) else method_step
    entry = build(args, name)
    device, data = entry.device, entry.data
    if name in bench_data.MEMORY:
        bench_data.AnonPeak.reset()
    seconds = timed(entry.step, device, warmup=args.warmup, steps=args.steps, repeats=args.repeats)
    if isinstance(data, Waits):
        data_s = data.mean(args.steps * args.repeats)
    else:
        data_s = timed(data, device, warmup=args.warmup, steps=args.steps, repeats=args.repeats) if data else None
    model_entry = name not in bench_data.ENTRIES or name == "finetune/stream"
    flops = step_flops(entry.flops or entry.step) if model_entry else 0
    peak = peak_flops(device, args.peak_flops)
    peak_mem: float | None
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**20
    elif name in bench_data.MEMORY:
        peak_mem = bench_data.AnonPeak.peak
    elif args.in_process:
        peak_mem = None  # the process's peak so far, not this entry's
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "name": name,
        "backbone": args.backbone,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "images_per_step": entry.images or args.batch_size,
        "images_per_s": round((entry.images or args.batch_size) / seconds, 1),
        "step_ms": round(1000 * seconds, 2),
        "peak_mem_mb": None if peak_mem is None else round(peak_mem, 1),
        "mfu": flops / seconds / peak if peak else None,  # exact: the table rounds it for display
        "gflops_per_step": round(flops / 1e9, 3),
        "data_ms": None if data_s is None else round(1000 * data_s, 3),
    }


def target_ratios(results: list[dict[str, Any]]) -> dict[str, float | None]:
    """The README's step-time targets as ratios of measured entries (None where an entry is missing):
    finetune's speed relative to timm_train (>= 0.9 CPU, >= 0.95 CUDA) and to timm_compiled (>= 1.0 CUDA), the slowest
    method's step over finetune's (<= 1.25; the prompt methods aside), L2P's step over timm_frozen + timm_inference
    (<= 1.5), the slower of DualPrompt and CODA-Prompt over L2P (<= 1.5), (no target) the slowest of the survey's
    APD, CTR, KSM and TFM over finetune, and the slowest baseline's time per trained image (memory images counted)
    over finetune's (<= 1.25)."""
    ms = {r["name"]: r["step_ms"] for r in results if "step_ms" in r}
    per_image = {r["name"]: r["step_ms"] / (r.get("images_per_step") or 1) for r in results if "step_ms" in r}
    finetune, train = ms.get("finetune"), ms.get("reference/timm_train")
    others = [v for k, v in ms.items() if k in METHODS and k not in ("finetune", *PROMPTS, *SURVEY, *BASELINES)]
    baselines = [per_image[k] for k in BASELINES if k in per_image]
    survey = [ms[k] for k in SURVEY if k in ms]
    frozen, inference = ms.get("reference/timm_frozen"), ms.get("reference/timm_inference")
    successors = [ms[k] for k in PROMPTS[1:] if k in ms]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    return {
        "finetune_speed_vs_timm_train": ratio(train, finetune),
        "finetune_speed_vs_timm_compiled": ratio(ms.get("reference/timm_compiled"), finetune),
        "slowest_method_step_vs_finetune": ratio(max(others, default=None), finetune),
        "l2p_step_vs_frozen_plus_inference": ratio(ms.get("l2p"), frozen + inference if frozen and inference else None),
        "slowest_prompt_successor_step_vs_l2p": ratio(max(successors, default=None), ms.get("l2p")),
        "slowest_survey_method_step_vs_finetune": ratio(max(survey, default=None), finetune),
        "slowest_baseline_per_image_vs_finetune": ratio(max(baselines, default=None), per_image.get("finetune")),
    }


def median_round(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median step time (the lower middle for an even count); an error if every round failed."""
    timed_ok = sorted((e for e in entries if "step_ms" in e), key=lambda e: e["step_ms"])
    return timed_ok[(len(timed_ok) - 1) // 2] if timed_ok else entries[-1]


def measured_or_error(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """:func:`measure`, or the entry's error (reported in the table: the bench goes on)."""
    try:
        return measure(args, name)
    except Exception as err:
        return {"name": name, "error": f"{type(err).__name__}: {err}"}


def _child(args: argparse.Namespace, name: str, queue: mp.Queue) -> None:
    queue.put(measured_or_error(args, name))


def in_this_process(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """``--in-process``: one entry measured here, its CUDA peak its own and its memory given back after it."""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        return measured_or_error(args, name)
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def in_a_fresh_process(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One entry measured in a spawned process (its peak memory its own)."""
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_child, args=(args, name, queue))
    proc.start()
    proc.join()
    return queue.get() if not queue.empty() else {"name": name, "error": f"exit code {proc.exitcode}"}


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (a step count of 0 or -1 would time nothing, or time backwards)."""

    def parse_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not an integer >= {minimum}")
        return value

    return parse_int


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0")
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="clbench-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="vit_base_patch16_224" if cuda else "vit_micro")
    parser.add_argument("--image-size", type=at_least(8), default=224 if cuda else 32)
    parser.add_argument("--batch-size", type=at_least(1), default=128 if cuda else 32)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument(
        "--peak-flops", type=positive_float, default=None, help="the device's dense bf16 peak (FLOP/s) for MFU"
    )
    for flag in ("compile", "cuda-graphs"):
        key = flag.replace("-", "_")
        parser.add_argument(f"--{flag}", choices=("auto", "true", "false"), default="auto", help=f"trainer.{key}")
    # timm under torch.compile is the ceiling where methods compile (CUDA); on the CPU it is there on request
    references = REFERENCES if cuda else tuple(r for r in REFERENCES if r != "reference/timm_compiled")
    also = ", ".join(
        (*INFERENCE, "any <method>_cil/T=<k>", *bench_data.MEMORY, *(r for r in REFERENCES if r not in references))
    )
    default = [*METHODS, *references, *bench_data.DATA]
    parser.add_argument("--methods", nargs="+", default=default, help=f"entries (also {also})")
    parser.add_argument(
        "--workers", type=at_least(0), default=4, help="data entries: loader worker processes (both paths)"
    )
    parser.add_argument(
        "--data-images", type=at_least(1), default=4096, help="data entries: JPEGs in the bench's folder"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="data entries' files, kept for the next bench (default: a temporary folder, removed at the end)",
    )
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--rounds", type=at_least(1), default=1, help="measure the list this many times, interleaved")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="measure every entry in this process (no start-up per entry; the CPU's peak memory is not measured)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench.json"))
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the entries --out already holds (same settings, no error) and measure the rest",
    )
    parser.add_argument(
        "--time-limit",
        type=positive_float,
        default=None,
        help="seconds: start no entry that the longest one so far would carry past it; exit 3 with what is measured "
        "written (go on with --resume)",
    )
    args = parser.parse_args(argv)
    known = [*METHODS, *REFERENCES, *INFERENCE, *bench_data.DATA, *bench_data.MEMORY]
    unknown = {name for name in args.methods if name not in known and inference_entry(name) is None}
    if unknown:
        parser.error(f"unknown entries {sorted(unknown)}; choose from {known} or <method>_cil/T=<tasks>")
    try:  # before measuring anything: a report that cannot be written is refused at once
        if args.out.is_dir():
            raise ConfigError(f"--out {args.out} is a folder; name the file to write, e.g. {args.out / 'bench.json'}")
        check_writable(args.out.parent, hint="Choose another file with --out PATH.")
    except ConfigError as err:
        parser.error(str(err))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    done = measured_before(args)
    keep = args.data_dir is not None
    args.data_dir = (args.data_dir or Path(tempfile.mkdtemp(prefix="clbench-bench-"))).resolve()
    try:
        run_entries(args, done)
    finally:
        if not keep:
            shutil.rmtree(args.data_dir, ignore_errors=True)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two benches' entries comparable: kept in bench.json, checked by ``--resume``."""
    keys = [
        "backbone",
        "image_size",
        "batch_size",
        "device",
        "precision",
        "compile",
        "cuda_graphs",
        "warmup",
        "steps",
        "repeats",
        "in_process",
    ]
    return {key: getattr(args, key) for key in keys}


def measured_before(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--resume``: the entries ``--out`` already holds without an error, if it was measured with these settings."""
    if not args.resume or not args.out.exists():
        return {}
    try:
        report = json.loads(args.out.read_bytes())
        before, results = report["settings"], report["results"]
        named = isinstance(results, list) and all(isinstance(r, dict) and isinstance(r["name"], str) for r in results)
        if not named:
            raise TypeError("its results are not a list of entries, each with a name")
    except (OSError, ValueError, KeyError, TypeError) as err:  # ValueError: not JSON, or not text at all
        problem = f"{type(err).__name__}: {err.strerror if isinstance(err, OSError) else err}"
        problem = f"it or one of its entries has no {err} key" if isinstance(err, KeyError) else problem
        sys.exit(f"--resume: {args.out} is not a bench report ({problem}); move it away or drop --resume")
    if before != settings(args):
        sys.exit(f"--resume: {args.out} was measured with {before}, not {settings(args)}; move it away")
    return {r["name"]: r for r in results if "error" not in r}


def run_entries(args: argparse.Namespace, done: dict[str, dict[str, Any]]) -> None:
    """Measure the entries ``done`` does not hold yet, each in a fresh process, ``--rounds`` times."""
    from clbench.tracking import console

    if set(args.methods) & set(bench_data.DATA):
        bench_data.prepare(args)
    todo = [name for name in args.methods if name not in done]
    if done:
        console.print(f"--resume: {len(done)} entries kept from {args.out}, {len(todo)} to measure")
    rounds: dict[str, list[dict[str, Any]]] = {name: [done[name]] if name in done else [] for name in args.methods}
    began, longest = time.perf_counter(), 0.0
    for r in range(args.rounds):
        for name in todo:
            if args.time_limit and time.perf_counter() - began + longest > args.time_limit:
                left = sum(len(rounds[n]) <= r for n in todo) + len(todo) * (args.rounds - r - 1)
                console.print(f"--time-limit: stopped, {left} measurements to go (--resume goes on from here)")
                write_report(args, [median_round(e) for e in rounds.values() if e], complete=False)
                sys.exit(3)
            start = time.perf_counter()
            entry = (in_this_process if args.in_process else in_a_fresh_process)(args, name)
            entry["wall_s"] = round(time.perf_counter() - start, 1)  # the whole entry: start-up, compiling, timing
            longest = max(longest, entry["wall_s"])
            rounds[name].append(entry)
            shown = f"{entry['step_ms']} ms a step" if "step_ms" in entry else entry["error"]
            console.print(f"round {r + 1}/{args.rounds} {name}: {shown} ({entry['wall_s']} s)")
            write_report(args, [median_round(e) for e in rounds.values() if e], complete=False)
    results = [median_round(entries) for entries in rounds.values()]
    report = write_report(args, results, complete=True)
    show(args, report)
    if any("error" in r for r in results):
        sys.exit(1)


def write_report(args: argparse.Namespace, results: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
    """bench.json, rewritten atomically after every entry: a bench stopped midway keeps what it measured, and
    ``--resume`` goes on from there."""
    from clbench.files import write_atomic

    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    report = {
        "device": label,
        "peak_bf16_flops": peak_flops(device, args.peak_flops),
        "settings": settings(args),
        "complete": complete,
        "results": results,
        "target_ratios": target_ratios(results),
    }
    write_atomic(args.out, json.dumps(report, indent=2))
    return report


def show(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The report as a table, with the target ratios."""
    from rich.table import Table

    from clbench.tracking import console

    results, ratios, label = report["results"], report["target_ratios"], report["device"]
    table = Table(title=f"clbench bench on {label} ({args.backbone}, batch {args.batch_size}, {args.image_size}px)")
    for column in ("entry", "images/s", "step ms", "data %", "GFLOP", "peak MB", "MFU", "vs timm_train"):
        table.add_column(column, justify="left" if column == "entry" else "right", no_wrap=column == "entry")
    ref = next((r for r in results if r["name"] == "reference/timm_train" and "step_ms" in r), None)
    for r in results:
        if "error" in r:
            table.add_row(r["name"], "-", "-", "-", "-", "-", "-", r["error"][:60])
            continue
        ratio = f"{ref['step_ms'] / r['step_ms']:.2f}x" if ref else "-"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        data = "-" if r["data_ms"] is None else f"{100 * r['data_ms'] / r['step_ms']:.1f}"
        speed = (f"{r['images_per_s']:.1f}", f"{r['step_ms']:.1f}", data, f"{r['gflops_per_step']:.2f}")
        peak = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"
        table.add_row(r["name"], *speed, peak, mfu, ratio)
    console.print(table, width=max(console.width, 140))  # a SLURM log or a pipe gets every column
    console.print(f"written: {args.out}  (speed relative to reference/timm_train: > 1 is faster)")
    console.print("targets: " + ", ".join(f"{k} {v}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
