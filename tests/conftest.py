"""Shared fixtures: offline environment, config composition and a tiny run setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from clbench.config import RunConfig, config_dir, validate

if TYPE_CHECKING:
    import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


# A run that takes about a second on 2 CPU cores: 3 synthetic tasks of 2 classes, a 1-block 16px ViT.
TINY = [
    "data=synthetic_tiny",
    "data.num_tasks=3",
    "backbone=vit_micro",
    "backbone.pretrained=false",
    "backbone.img_size=16",
    "backbone.kwargs.depth=1",
    "backbone.kwargs.embed_dim=32",
    "backbone.kwargs.num_heads=2",
    "trainer.epochs=2",
    "trainer.batch_size=16",
    "logger.mode=disabled",
]


def run_command(*command: str, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """A command as a user runs it, offline and unbuffered, with temporary files (torchrun's, W&B's) in a
    temporary folder of its own, removed after it; ``env`` adds variables. The folder sits in the system's temporary
    folder, not under ``cwd``: a socket path (the data stream's forkserver) must stay under 108 characters, and a
    pytest-xdist worker's ``tmp_path`` is longer. The exit code is what the tests check; one still running after
    ``timeout`` seconds fails the test."""
    with tempfile.TemporaryDirectory(prefix="clbench-") as scratch:
        offline = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "TMPDIR": scratch}
        return subprocess.run(  # noqa: PLW1510
            command, cwd=cwd, env={**os.environ, **offline, **env}, capture_output=True, text=True, timeout=timeout
        )


def clbench(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -m clbench ARGS`` (what the ``clbench`` command runs)."""
    return run_command(sys.executable, "-m", "clbench", *args, cwd=cwd, **env)


CRASH = re.compile(r"terminate called|what\(\)|Fatal Python error|Traceback|Error:|Aborted|Segmentation")


def said(out: subprocess.CompletedProcess) -> str:
    """What a failed command said, for an assertion: the lines anywhere in its stderr that name a crash (a rank's
    abort, printed before rank 0's summary, falls outside any tail) and the last 3000 characters."""
    crashes = [line for line in out.stderr.splitlines() if CRASH.search(line)]
    return "\n".join([*crashes[:40], "...", out.stderr[-3000:]])


def torchrun(nproc: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=NPROC -m clbench ARGS``: the single-node launch, whose rendezvous takes
    a free port, so that runs of parallel test workers do not meet on torchrun's default port 29500."""
    launcher = str(Path(sys.executable).with_name("torchrun"))
    return run_command(launcher, "--standalone", f"--nproc_per_node={nproc}", "-m", "clbench", *args, cwd=cwd)


def fused_attention_ops() -> tuple[str, ...]:
    """The aten operators of every fused backend ``F.scaled_dot_product_attention`` may dispatch to, named after
    torch's own list of backends (``SDPBackend``: flash, memory-efficient, cuDNN, ...; the unfused math path and the
    placeholders aside): ``aten::_scaled_dot_product_<backend>`` and its CPU variant ``..._for_cpu``."""
    from torch.nn.attention import SDPBackend

    unfused = {"MATH", "ERROR", "OVERRIDEABLE"}
    return tuple(f"aten::_scaled_dot_product_{name.lower()}" for name in SDPBackend.__members__ if name not in unfused)


SOFTMAX_OPS = {  # the dispatcher's softmax family, forward and backward
    "aten::softmax",
    "aten::_softmax",
    "aten::_safe_softmax",
    "aten::log_softmax",
    "aten::_log_softmax",
    "aten::_softmax_backward_data",
    "aten::_log_softmax_backward_data",
}


def attention_ops(step: Callable[[], object], *, cuda: bool = False) -> tuple[set[str], set[str]]:
    """The operators of one eager ``step`` (after a warm-up call), read from the dispatcher's events, not from kernel
    names: the fused scaled-dot-product attention ones, and any softmax of attention maps: an operator of the softmax
    family applied to a tensor of rank 3 or more (attention maps are (batch, heads, queries, keys); cross-entropy's
    log-softmax over (batch, classes) is not one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages(group_by_input_shape=True)
    fused = {e.key for e in events if e.key.startswith(fused_attention_ops())}
    maps = {
        f"{e.key}{e.input_shapes}"
        for e in events
        if e.key in SOFTMAX_OPS and e.input_shapes and len(e.input_shapes[0]) >= 3
    }
    return fused, maps


def baselines_slow(methods: tuple[str, ...] | list[str], also: tuple[str, ...] = ()) -> list:
    """``methods`` as pytest parameters, the seed tables' baselines (clbench.methods.BASELINES) and ``also`` under
    the ``slow`` marker: their own test files check them in the default suite, the every-method runs in ``make
    test-all`` (the default suite stays within its 15 minutes on 2 cores)."""
    from clbench.methods import BASELINES

    return [pytest.param(m, marks=pytest.mark.slow) if m in (*BASELINES, *also) else m for m in methods]


def crash_and_resume(monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...], folder: Path, step: int) -> None:
    """Train ``overrides`` into ``folder`` until its ``step``-th training step raises (a power cut), then run it
    again with ``resume=true``: the folder then holds the resumed run's results."""
    from clbench.loop import step as step_module
    from clbench.loop import train

    calls, real = {"n": 0}, step_module.train_step

    def crashing(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == step:
            raise RuntimeError("power cut")
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "train_step", crashing)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_config(*overrides), folder)
    monkeypatch.undo()
    train(tiny_config(*overrides, "resume=true"), folder)


def compose_config(*overrides: str) -> DictConfig:
    """The config exactly as the CLI composes it (without the hydra node)."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# What fits TINY's one-block backbone where a method's official blocks do not exist there (DualPrompt's E-prompts in
# blocks 2-4): block 0 then carries both of its prompts, [G, E]; and TINY's one or two epochs where a method's stages
# keep their own (HiDe's TII training and two alignments).
TINY_FIT = {
    "dualprompt": ("method.g_layers=[0]", "method.e_layers=[0]"),
    "hide": (
        "method.layers=[0]",
        "method.tii.epochs=1",
        "method.tii_alignment.epochs=2",
        "method.tap_alignment.epochs=2",
    ),
}


def tiny_fit(*overrides: str) -> tuple[str, ...]:
    """The TINY_FIT overrides of the method named in ``overrides``, placed before them (theirs win)."""
    return tuple(o for method, fit in TINY_FIT.items() if f"method={method}" in overrides for o in fit)


def tiny_config(*overrides: str) -> RunConfig:
    return validate(compose_config(*TINY, *tiny_fit(*overrides), *overrides))


def trained_task_by_task(cfg: RunConfig) -> tuple:
    """The run's method (in eval mode) and runtime after every task trained as the loop runs it: ``before_task``, the
    task's phases (``run_task``), ``after_task``."""
    from clbench.loop.runtime import build_runtime

    method, rt = build_runtime(cfg)
    train_tasks(method, rt, len(rt.benchmark.tasks))
    return method.eval(), rt


def train_tasks(method, rt, count: int) -> None:
    """The run's first ``count`` tasks trained as the loop trains them (``rt.cfg.trainer.epochs``)."""
    from clbench.loop.task import run_task

    for task in rt.benchmark.tasks[:count]:
        method.before_task(task)
        run_task(method, task, rt, epochs=rt.cfg.trainer.epochs)
        method.after_task(task)


def optimized(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Every parameter ``optimizer`` steps (a train step's ``params``)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def one_step_into(method, rt, task_id: int) -> None:
    """The run's tasks before ``task_id`` trained as the loop trains them (``rt.cfg.trainer.epochs``), then one step of
    ``task_id``'s first phase on its first 16 images: a checkpoint's position mid-task."""
    from clbench.loop.optim import build_optimizer
    from clbench.loop.step import train_step

    train_tasks(method, rt, task_id)
    task = rt.benchmark.tasks[task_id]
    method.before_task(task)
    phase = method.phases(task, rt.cfg.trainer.epochs)[0]
    method.before_phase(task, phase)
    optimizer = build_optimizer(method, task, phase, rt.cfg.trainer)
    x, y = rt.benchmark.train[task_id].batch(None, 0, 16)
    train_step(method, task, rt, x, y, optimizer=optimizer, params=optimized(optimizer))


def assert_replays(method, fresh, rt, task_id: int) -> None:
    """``fresh`` (the same run's method under another seed), walked by the loop's replay to ``method``'s position one
    step into ``task_id``'s first phase (:func:`one_step_into`), takes ``method``'s state_dict back exactly and
    predicts the same classes without the task id."""
    import torch

    from clbench.checkpoint import Cursor, Position
    from clbench.loop.resume import replay

    state = method.state_dict()
    replay(fresh, rt.benchmark.tasks, Position(task=task_id, step=0, cursor=Cursor(phase=0)), rt.cfg.trainer.epochs)
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key
    probe = rt.test_tf(rt.benchmark.test[0].x)
    assert torch.equal(fresh.eval().predict(probe, None), method.eval().predict(probe, None))


@pytest.fixture(autouse=True)
def _isolated_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
