"""`make bench` / `python -m clbench.bench`: training-step throughput of every method against two references.

Each method takes its real training step (:func:`clbench.run.train_step`: device augmentation, loss, backward,
gradient surgery, optimizer, constraints) on its first task of a synthetic benchmark, with the chosen backbone,
batch and image size. References on the same device, precision and input size:
- ``reference/timm_train``: a plain timm ViT with a classifier, cross-entropy, AdamW (fused on CUDA);
- ``reference/timm_frozen``: a frozen timm ViT, forward and backward to the input (what prompt methods pay);
- ``reference/timm_inference``: one inference-mode forward (L2P's query pass; its target is frozen + inference).
``supsup_cil/T=k`` (not in the default list) times SupSup's class-incremental prediction of one batch after k tasks
(one-shot task inference through the superposed masks, then the inferred tasks' passes): its peak memory shows that
the superposition's backward does not grow with the number of tasks.
Every figure is the median over ``--repeats`` timings of ``--steps`` steps after ``--warmup`` steps. Each entry
runs in its own process, so its peak memory is its own (CUDA: max allocated; CPU: max resident set size).
``--rounds K`` measures the whole list K times, interleaved, and keeps each entry's median round, so that drift
of a shared machine affects every entry alike (ratios between entries are then trustworthy).
FLOPs of one step are counted with torch's FlopCounterMode on every device; model-FLOP utilisation = FLOPs / step
time / the device's dense bf16 peak (from a table of GPUs, or ``--peak-flops``), null where no peak is known (CPU).
A method's ``data_ms`` is the part of its step spent fetching the batch and augmenting it on the device.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

METHODS = ("finetune", "joint", "packnet", "piggyback", "supsup", "hat", "meat", "l2p")
REFERENCES = ("reference/timm_train", "reference/timm_frozen", "reference/timm_inference")
# SupSup's class-incremental evaluation step (one-shot task inference, then the inferred tasks' passes) after T tasks:
# its peak memory must not grow with T.
INFERENCE = ("supsup_cil/T=2", "supsup_cil/T=5", "supsup_cil/T=10")
# Dense bf16 tensor-core peaks (vendor datasheets); the first name contained in the device's name wins.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
}


def peak_flops(device: torch.device, given: float | None = None) -> float | None:
    """``given`` (--peak-flops) if set, else the table's peak for this GPU; None on CPU or an unknown GPU."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def timed(step: Callable[[], Any], device: torch.device, *, warmup: int, steps: int, repeats: int) -> float:
    """Median seconds per step."""
    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_step = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        per_step.append((time.perf_counter() - start) / steps)
    return statistics.median(per_step)


def step_flops(step: Callable[[], Any]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def overrides(args: argparse.Namespace, method: str, tasks: int = 1) -> list[str]:
    return [
        f"method={method}",
        f"backbone={args.backbone}",
        f"backbone.img_size={args.image_size}",
        "data=synthetic_tiny",
        f"data.synthetic_classes={2 * tasks}",
        f"data.synthetic_train_per_class={args.batch_size}",
        "data.synthetic_test_per_class=1",
        f"data.tasks={tasks}",
        f"data.synthetic_image_size={args.image_size}",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.device={args.device}",
        f"trainer.precision={args.precision}",
        "logger.mode=disabled",
    ]


# (step, its data part: timed alone, or the waits recorded during the step; or None, device)
Steps = tuple[Callable[[], Any], Any, torch.device]


def method_step(args: argparse.Namespace, name: str, extra: tuple[str, ...] = ()) -> Steps:
    """A method's training step on a fixed batch of the synthetic benchmark, and its data part (fetch + augment).
    With ``extra`` overrides that stream the data (``finetune/stream``), each step takes the next streamed batch and
    the data part is the time it waited for it (:class:`clbench.bench_data.Waits`)."""
    from hydra import compose, initialize_config_dir

    from clbench.bench_data import Waits
    from clbench.cli import config_dir
    from clbench.config import validate
    from clbench.run import build_optimizer, build_runtime, train_step

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = validate(compose("config", overrides=[*overrides(args, name), *extra]))
    method, rt = build_runtime(cfg)
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    phase = method.phases(task, 1)[0]
    method.before_phase(task, phase)
    optimizer = build_optimizer(method, method.param_groups(task, phase), cfg.trainer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    split = rt.benchmark.train[0]
    order = split.permutation()
    method.train()
    batches = split.num_batches(args.batch_size)
    waits = Waits(split, args.batch_size) if extra else None

    def step() -> None:  # what the loop does per batch
        x, y = waits.next() if waits else split.batch(order, 0, args.batch_size)
        method.before_step(task, 0, batches)
        train_step(method, task, rt, x, y, optimizer=optimizer, params=params)

    def data() -> None:
        rt.train_tf(split.batch(order, 0, args.batch_size)[0])

    return step, waits or data, rt.device


def inference_step(args: argparse.Namespace, name: str) -> Steps:
    """SupSup's class-incremental prediction of one batch after T tasks (masks as drawn at their start)."""
    from hydra import compose, initialize_config_dir

    from clbench.cli import config_dir
    from clbench.config import validate
    from clbench.run import build_runtime, finish_untrained

    tasks = int(name.rsplit("=", 1)[1])
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = validate(compose("config", overrides=overrides(args, "supsup", tasks)))
    method, rt = build_runtime(cfg)
    for task in rt.benchmark.tasks:
        method.before_task(task)
        finish_untrained(method, task)
    method.eval()
    x = rt.test_tf(rt.benchmark.train[0].batch(None, 0, args.batch_size)[0])

    def step() -> None:
        with rt.autocast:
            method.predict(x, None)

    return step, None, rt.device


def reference_step(args: argparse.Namespace, name: str) -> Steps:
    from hydra import compose, initialize_config_dir

    from clbench.backbones import build_backbone
    from clbench.cli import config_dir
    from clbench.config import validate
    from clbench.run import autocast_for, resolve_device

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = validate(compose("config", overrides=overrides(args, "finetune")))
    device = resolve_device(cfg.trainer.device)
    model = build_backbone(cfg.backbone).to(device)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    autocast = autocast_for(device, cfg.trainer.precision)
    if name == "reference/timm_train":
        model.reset_classifier(10)
        model.to(device).train()
        fused = {"fused": True} if device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        y = torch.randint(0, 10, (args.batch_size,), device=device)

        def step() -> None:
            with autocast:
                loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        return step, None, device
    model.requires_grad_(False)
    if name == "reference/timm_inference":
        model.eval()

        def inference_step() -> None:
            with torch.inference_mode(), autocast:
                model.forward_head(model.forward_features(x), pre_logits=True)

        return inference_step, None, device
    x.requires_grad_(True)

    def frozen_step() -> None:
        with autocast:
            out = model.forward_head(model.forward_features(x), pre_logits=True)
        out.float().sum().backward()
        x.grad = None

    return frozen_step, None, device


def measure(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One entry, measured in this process (run in a fresh one by :func:`main`)."""
    torch.manual_seed(0)
    from clbench import bench_data

    if name in bench_data.ENTRIES:
        build = bench_data.build
    else:
        build = reference_step if name in REFERENCES else inference_step if name in INFERENCE else method_step
    step, data, device = build(args, name)
    if name in bench_data.MEMORY:
        bench_data.AnonPeak.reset()
    seconds = timed(step, device, warmup=args.warmup, steps=args.steps, repeats=args.repeats)
    if isinstance(data, bench_data.Waits):
        data_s = data.mean(args.steps * args.repeats)
    else:
        data_s = timed(data, device, warmup=args.warmup, steps=args.steps, repeats=args.repeats) if data else None
    flops = 0 if name in bench_data.ENTRIES and name != "finetune/stream" else step_flops(step)
    peak = peak_flops(device, args.peak_flops)
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**20
    elif name in bench_data.MEMORY:
        peak_mem = bench_data.AnonPeak.peak
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "name": name,
        "backbone": args.backbone,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "images_per_s": round(args.batch_size / seconds, 1),
        "step_ms": round(1000 * seconds, 2),
        "peak_mem_mb": round(peak_mem, 1),
        "mfu": round(flops / seconds / peak, 4) if peak else None,
        "gflops_per_step": round(flops / 1e9, 3),
        "data_ms": None if data_s is None else round(1000 * data_s, 3),
    }


def target_ratios(results: list[dict[str, Any]]) -> dict[str, float | None]:
    """The README's step-time targets as ratios of measured entries (None where an entry is missing):
    finetune's speed relative to timm_train (>= 0.9 CPU, >= 0.95 CUDA), the slowest other method's step over
    finetune's (<= 1.5), L2P's step over timm_frozen + timm_inference (<= 1.5)."""
    ms = {r["name"]: r["step_ms"] for r in results if "step_ms" in r}
    finetune, train = ms.get("finetune"), ms.get("reference/timm_train")
    others = [v for k, v in ms.items() if k in METHODS and k not in ("finetune", "l2p")]
    frozen, inference = ms.get("reference/timm_frozen"), ms.get("reference/timm_inference")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    return {
        "finetune_speed_vs_timm_train": ratio(train, finetune),
        "slowest_method_step_vs_finetune": ratio(max(others, default=None), finetune),
        "l2p_step_vs_frozen_plus_inference": ratio(ms.get("l2p"), frozen + inference if frozen and inference else None),
    }


def median_round(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median step time (the lower middle for an even count); an error if every round failed."""
    timed_ok = sorted((e for e in entries if "step_ms" in e), key=lambda e: e["step_ms"])
    return timed_ok[(len(timed_ok) - 1) // 2] if timed_ok else entries[-1]


def _child(args: argparse.Namespace, name: str, queue: mp.Queue) -> None:
    try:
        queue.put(measure(args, name))
    except Exception as err:  # reported in the table, the bench goes on
        queue.put({"name": name, "error": f"{type(err).__name__}: {err}"})


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="clbench-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="vit_base_patch16_224" if cuda else "vit_micro")
    parser.add_argument("--image-size", type=int, default=224 if cuda else 32)
    parser.add_argument("--batch-size", type=int, default=128 if cuda else 32)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--peak-flops", type=float, default=None, help="the device's dense bf16 peak (FLOP/s) for MFU")
    from clbench.bench_data import DATA, MEMORY

    also = ", ".join((*INFERENCE, *MEMORY))
    parser.add_argument("--methods", nargs="+", default=[*METHODS, *REFERENCES, *DATA], help=f"entries (also {also})")
    parser.add_argument("--workers", type=int, default=4, help="data entries: loader worker processes (both paths)")
    parser.add_argument("--data-images", type=int, default=4096, help="data entries: JPEGs in the bench's folder")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="data entries' files, kept for the next bench (default: a temporary folder, removed at the end)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="measure the list this many times, interleaved")
    parser.add_argument("--out", type=Path, default=Path("bench.json"))
    args = parser.parse_args(argv)
    known = [*METHODS, *REFERENCES, *INFERENCE, *DATA, *MEMORY]
    unknown = set(args.methods) - set(known)
    if unknown:
        parser.error(f"unknown entries {sorted(unknown)}; choose from {known}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    keep = args.data_dir is not None
    args.data_dir = (args.data_dir or Path(tempfile.mkdtemp(prefix="clbench-bench-"))).resolve()
    try:
        run_entries(args)
    finally:
        if not keep:
            shutil.rmtree(args.data_dir, ignore_errors=True)


def run_entries(args: argparse.Namespace) -> None:
    from rich.table import Table

    from clbench.bench_data import DATA, prepare
    from clbench.files import write_atomic
    from clbench.tracking import console

    if set(args.methods) & set(DATA):
        prepare(args)
    ctx = mp.get_context("spawn")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in args.methods}
    for r in range(args.rounds):
        for name in args.methods:
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(args, name, queue))
            proc.start()
            proc.join()
            entry = queue.get() if not queue.empty() else {"name": name, "error": f"exit code {proc.exitcode}"}
            rounds[name].append(entry)
            console.print(f"round {r + 1}/{args.rounds} {name}: {entry.get('step_ms', entry.get('error'))}")
    results = [median_round(entries) for entries in rounds.values()]
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    ratios = target_ratios(results)
    report = {
        "device": label,
        "peak_bf16_flops": peak_flops(device, args.peak_flops),
        "results": results,
        "target_ratios": ratios,
    }
    write_atomic(args.out, json.dumps(report, indent=2))
    table = Table(title=f"clbench bench on {label} ({args.backbone}, batch {args.batch_size}, {args.image_size}px)")
    for column in ("entry", "images/s", "step ms", "data %", "GFLOP", "peak MB", "MFU", "vs timm_train"):
        table.add_column(column, justify="left" if column == "entry" else "right")
    ref = next((r for r in results if r["name"] == "reference/timm_train" and "step_ms" in r), None)
    for r in results:
        if "error" in r:
            table.add_row(r["name"], "-", "-", "-", "-", "-", "-", r["error"][:60])
            continue
        ratio = f"{ref['step_ms'] / r['step_ms']:.2f}x" if ref else "-"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        data = "-" if r["data_ms"] is None else f"{100 * r['data_ms'] / r['step_ms']:.1f}"
        speed = (f"{r['images_per_s']:.1f}", f"{r['step_ms']:.1f}", data, f"{r['gflops_per_step']:.2f}")
        table.add_row(r["name"], *speed, f"{r['peak_mem_mb']:.0f}", mfu, ratio)
    console.print(table)
    console.print(f"written: {args.out}  (speed relative to reference/timm_train: > 1 is faster)")
    console.print("targets: " + ", ".join(f"{k} {v}" for k, v in ratios.items()))
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
