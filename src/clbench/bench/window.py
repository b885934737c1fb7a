"""`make gpu-window`: the GPU checks that fit one lent GPU window, as one command that stops within ``--budget``
seconds (480 by default: a window's command may run 10 minutes, and one rerun must still fit the window's 15).

Two parts, in this order, each writing under ``--out`` as it goes, so a window cut short keeps what it measured:

1. **smoke** (its share of the budget): the gpu suite's per-method checks in one pytest process: a phase as a run
   takes it (warm-up, capture, replays) in bf16, no host sync in a graph's replay, CUDA fp32 against the CPU on one
   step, and the pinned-host memory's tests. ``smoke.xml`` (JUnit) and ``smoke.log``; pytest is interrupted at its
   share, which still writes the XML of what ran.
2. **bench** (the rest): ``make bench`` at ViT-B/16 (224 px, batch 128, bf16) for every method beside plain timm,
   every entry in one process (``--in-process``), into ``bench.json``. ``--bench-compile false`` (the default) steps
   each method as a graph-replayed eager step, the mode whose figures cover every method in one window;
   ``auto`` compiles as a CUDA run does (about 40 s an entry: a window reaches part of the list). ``--resume FILE``
   goes on from an earlier window's bench.json.

``window.json`` says what ran, for how long, and what is left for the next window. ``--dry-run`` (a machine without
a GPU) runs the same command with the GPU parts stubbed out: pytest collects the smoke and skips it, and the bench's
entries run in one process on the CPU at the micro ViT's shape: what the window's command costs besides the GPU work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from clbench.bench.cli import positive_float
from clbench.bench.models import METHODS
from clbench.files import write_atomic

ROOT = Path(__file__).resolve().parents[3]
# The gpu suite's per-method checks: a run's phase with capture and replays (bf16), a replay without a host sync, one
# step against the CPU; and the memory held in pinned host memory.
SMOKE = (
    "(steps_and_evaluation and bf16) or (no_hidden_host_sync and graph) or cuda_fp32_matches "
    "or pinned_host_memory or replaying_from_pinned"
)
REFERENCES = ("reference/timm_train", "reference/timm_compiled")
INTERRUPT_GRACE_S = 30  # pytest's wind-down after SIGINT: it finishes the test in flight and writes its XML


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="clbench-gpu-window", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-window")), help="default: $OUT")
    parser.add_argument("--budget", type=positive_float, default=480.0, help="seconds for the whole command")
    parser.add_argument("--smoke-share", type=positive_float, default=0.5, help="the smoke's share of the budget")
    parser.add_argument("--bench-compile", choices=("false", "auto"), default="false", help="the bench's --compile")
    parser.add_argument("--resume", type=Path, default=None, help="an earlier window's bench.json to go on from")
    parser.add_argument("--dry-run", action="store_true", help="without a GPU: the command with GPU parts stubbed out")
    args = parser.parse_args(argv)
    if args.smoke_share >= 1:
        parser.error("--smoke-share must be below 1: the bench needs the rest")
    if args.resume is not None and not args.resume.is_file():
        parser.error(f"--resume {args.resume}: no such file")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error(f"torch {torch.__version__} sees no CUDA GPU; --dry-run times the command without one")
    if not (ROOT / "tests" / "test_gpu.py").is_file():
        parser.error(f"the smoke runs the repository's tests/test_gpu.py, which is not under {ROOT}: run a checkout")
    return args


def interruptible() -> None:
    """In a part's process before it starts: SIGINT back to its default action (Python's KeyboardInterrupt), let
    through."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def run_until(command: list[str], seconds: float, log: Path) -> dict[str, Any]:
    """Run ``command`` from the repository root, its output into ``log``; past ``seconds``, interrupt it (SIGINT: it
    winds down and writes what it has), then kill it. Its return code, wall time and whether it was stopped. The part
    starts with SIGINT's default action and unblocked, whatever this process inherited (a shell's background job
    ignores SIGINT, and a child would inherit that and never wind down)."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
            preexec_fn=interruptible,  # noqa: PLW1509 (the window runs no threads of its own)
        )
        stopped = False
        try:
            proc.wait(timeout=max(seconds, 1.0))
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"returncode": proc.returncode, "wall_s": round(time.perf_counter() - start, 1), "stopped": stopped}


def junit_outcomes(path: Path) -> dict[str, Any]:
    """Counts and failures of a JUnit XML report (pytest's ``--junitxml``)."""
    if not path.is_file():
        return {"passed": 0, "failed": [], "skipped": 0, "report": None}
    passed, skipped, failed = 0, 0, []
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed.append({"test": case.get("name"), "message": (problem.get("message") or "")[:500]})
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return {"passed": passed, "failed": failed, "skipped": skipped, "report": path.name}


def smoke(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    xml = args.out / "smoke.xml"
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"]
    run = run_until([*command, "-k", SMOKE, f"--junitxml={xml.resolve()}"], seconds, args.out / "smoke.log")
    return {"part": "smoke", **run, **junit_outcomes(xml)}


def bench(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    out = args.out / "bench.json"
    if args.resume is not None:
        shutil.copyfile(args.resume, out)
    shape = ["--backbone", "vit_micro", "--image-size", "32", "--batch-size", "32", "--device", "cpu"]
    if not args.dry_run:
        shape = ["--backbone", "vit_base_patch16_224", "--image-size", "224", "--batch-size", "128"]
    entries = [*METHODS, *(REFERENCES if not args.dry_run else REFERENCES[:1])]
    command = [sys.executable, "-m", "clbench.bench", *shape, "--in-process", "--compile", args.bench_compile]
    command += ["--out", str(out.resolve()), "--time-limit", str(max(seconds, 1.0)), "--methods", *entries]
    run = run_until([*command, *(["--resume"] if args.resume else [])], seconds + 60, args.out / "bench.log")
    report = json.loads(out.read_text()) if out.is_file() else {"results": [], "complete": False}
    measured = [r["name"] for r in report["results"] if "step_ms" in r]
    errors = {r["name"]: r["error"] for r in report["results"] if "error" in r}
    left = [name for name in entries if name not in measured and name not in errors]
    return {"part": "bench", **run, "measured": len(measured), "errors": errors, "left": left, "report": out.name}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    cuda = not args.dry_run
    window = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run: GPU parts stubbed out)",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "budget_s": args.budget,
        "bench_compile": args.bench_compile,
        "parts": [],
    }

    def record(part: dict[str, Any]) -> None:
        window["parts"].append(part)
        window["wall_s"] = round(time.perf_counter() - began, 1)
        write_atomic(args.out / "window.json", json.dumps(window, indent=2))
        print(f"{part['part']}: {json.dumps({k: v for k, v in part.items() if k != 'part'})}", flush=True)

    record(smoke(args, args.budget * args.smoke_share))
    # The bench stops starting entries before the budget's end (its --time-limit); what it leaves is listed.
    record(bench(args, args.budget - (time.perf_counter() - began)))
    if any(p["returncode"] not in (0, 3) for p in window["parts"]) or window["parts"][0]["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
