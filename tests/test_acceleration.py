"""How the step runs (`trainer.compile`, `trainer.cuda_graphs`), checked on the CPU: what auto picks and what is
refused, every method's forward compiles as one graph, compiled steps equal eager ones, full batches take the compiled
loss and an epoch's last batch the eager one, a compile failure falls back with one warning, learning rates as device
tensors follow the schedule, and the run says what it runs. The CUDA halves (capture, replay) are in test_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from clbench.config import validate
from clbench.distributed import Ranks
from clbench.errors import ConfigError
from clbench.loop import train
from clbench.loop.optim import lr_factor, schedulers_fill_tensor_rates
from clbench.loop.runtime import Acceleration, acceleration, build_runtime, graph_blocker
from clbench.loop.task import run_task
from clbench.methods import TRAINED
from clbench.methods.finetune import Finetune
from conftest import baselines_slow, compose_config, tiny_config

METHODS = TRAINED
CUDA = torch.device("cuda")  # a device object only: nothing below touches a GPU


def test_auto_compiles_and_captures_only_on_cuda_and_true_is_refused_where_it_cannot_apply() -> None:
    cfg = tiny_config()
    assert acceleration(cfg, torch.device("cpu"), Ranks()) == Acceleration(False, False, "the device is not CUDA")
    assert acceleration(cfg, CUDA, Ranks()) == Acceleration(True, True, None)
    assert graph_blocker(cfg, CUDA, Ranks(0, 2)) == "a multi-process (DDP) run"
    assert "mixup" in str(graph_blocker(tiny_config("trainer.mixup=0.8", "method=hat"), CUDA, Ranks()))
    assert "randaugment" in str(graph_blocker(tiny_config("data.randaugment_ops=2"), CUDA, Ranks()))
    assert acceleration(tiny_config("trainer.compile=true"), torch.device("cpu"), Ranks()).compile
    off = acceleration(tiny_config("trainer.cuda_graphs=false", "trainer.compile=false"), CUDA, Ranks())
    assert off == Acceleration(False, False, "trainer.cuda_graphs=false")
    with pytest.raises(ConfigError, match="a multi-process"):
        acceleration(tiny_config("trainer.cuda_graphs=true"), CUDA, Ranks(0, 2))
    with pytest.raises(ConfigError, match=r"cuda_graphs.*CUDA graphs need a CUDA device"):
        tiny_config("trainer.cuda_graphs=true", "trainer.device=cpu")
    with pytest.raises(ConfigError, match=r"cuda_graphs.*draw the mixing on the host"):
        tiny_config("trainer.cuda_graphs=true", "trainer.cutmix=1.0", "method=hat")
    with pytest.raises(ConfigError, match=r"trainer.compile.*auto, true or false"):
        tiny_config("trainer.compile=sometimes")


def test_a_method_that_keeps_step_state_on_the_host_is_not_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Finetune, "graph_safe", False)
    assert graph_blocker(tiny_config(), CUDA, Ranks()) == "the method draws per-step values on the host"


# InfLoRA's forward is SD-LoRA's LoRA part (parts/lora.py) on other targets: its case runs in make test-all, as APD's
# and CTR's (5-9 s: T copies of every block Linear, two capsule plugins a block; KSM and TFM keep the survey's).
@pytest.mark.parametrize(
    "method_name",
    [pytest.param(m, marks=pytest.mark.slow) if m in ("inflora", "apd", "ctr") else m for m in baselines_slow(METHODS)],
)
def test_every_method_forward_and_loss_compile_as_one_graph(method_name: str) -> None:
    """torch._dynamo.explain of ``training_loss`` on the micro ViT (4 blocks), for the first task and for the second
    (stored masks, cumulative gates, frozen slots), in the task's last phase (SLCA's second: its alignment, on drawn
    features): one graph, no graph break."""
    cfg = validate(compose_config(f"method={method_name}", "trainer.device=cpu", "logger.mode=disabled"))
    method, rt = build_runtime(cfg)
    for task in rt.benchmark.tasks[:2]:
        method.before_task(task)
        phases = method.phases(task, 1)
        for phase in phases:
            method.before_phase(task, phase)
        method.train()
        if phases[-1].data == "features":
            x, y = method.drawn_split(task, phases[-1], 0).batch(None, 0, 8)
        else:
            x_raw, y = rt.benchmark.train[task.id].batch(None, 0, 8)
            x = rt.train_tf(x_raw)
        torch._dynamo.reset()
        ids = {"ids": torch.arange(len(y))} if method.takes_ids() else {}  # positions of a recorded teacher's logits
        explained = torch._dynamo.explain(method.training_loss)(x, y, task, **ids)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        method.after_task(task)


def stepped(method_name: str, compiled: bool) -> dict[str, torch.Tensor]:
    """The method's state after one epoch of its first task, compiled or eager, without random draws (the test
    transform for training, MEAT's noise-free Gumbel sample): inductor draws its own random numbers."""
    cfg = tiny_config(f"method={method_name}", f"trainer.compile={str(compiled).lower()}")
    method, rt = build_runtime(cfg)
    rt.train_tf = rt.test_tf
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    run_task(method, task, rt, epochs=1)
    state = method.state_dict()  # the tensors (a memory's extra state, its host counters, aside)
    return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(  # HAT in the default suite; inductor's CPU compile takes ~30 s a method on 2 cores
    "method_name", ["hat", *(pytest.param(m, marks=pytest.mark.slow) for m in METHODS if m != "hat")]
)
def test_a_compiled_epoch_equals_the_eager_one(method_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor on the CPU, a whole epoch (HAT's s annealed batch by batch through its tensor): the same parameters
    to fp32 rounding, and a graph really compiled."""
    from test_gpu import comparable, without_noise

    without_noise(monkeypatch)
    before = counters["stats"]["unique_graphs"]
    compiled = stepped(method_name, True)
    assert counters["stats"]["unique_graphs"] > before
    for key, value in stepped(method_name, False).items():  # the attention key bias aside: its gradient is exactly 0
        torch.testing.assert_close(
            comparable(key, compiled[key]), comparable(key, value), rtol=1e-4, atol=1e-5, msg=key
        )


def test_full_batches_take_the_compiled_loss_and_the_last_batch_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """An epoch's full batches of 16 go through the compiled loss, its smaller last batch eagerly, so no second graph
    is compiled for that shape."""
    sizes: dict[str, list[int]] = {"compiled": [], "eager": []}
    method, rt = build_runtime(tiny_config("trainer.compile=true"))
    real = method.training_loss

    def traced(x, y, task):
        sizes["eager"].append(len(x))
        return real(x, y, task)

    def fake_compile(fn, **_):
        def run(x, y, task):
            sizes["compiled"].append(len(x))
            return real(x, y, task)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(method, "training_loss", traced)
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    run_task(method, task, rt, epochs=1)
    full, rest = divmod(len(rt.benchmark.train[0]), 16)
    assert rest and sizes == {"compiled": [16] * full, "eager": [rest]}


def test_a_compile_failure_warns_once_and_trains_as_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The run ends with the eager run's matrices (the batch goes through the eager loss, nothing drawn twice), says
    why once, and records the failure in results.json."""

    def exploding(fn, **_):
        def run(*args, **kwargs):
            raise TorchDynamoException("the backend exploded")

        return run

    eager = train(tiny_config("method=meat"), tmp_path / "eager")
    monkeypatch.setattr(torch, "compile", exploding)
    capsys.readouterr()
    fallen = train(tiny_config("method=meat", "trainer.compile=true"), tmp_path / "fallen")
    assert capsys.readouterr().err.count("torch.compile failed") == 1
    assert fallen.rows == eager.rows
    saved = json.loads((tmp_path / "fallen" / "results.json").read_text())["acceleration"]
    assert saved["compile"] is True and "the backend exploded" in saved["compile_failure"]


def test_learning_rates_as_tensors_follow_the_schedule_in_place() -> None:
    """What a CUDA graph relies on: the schedule writes each new rate into the tensor the optimizer holds (the
    captured one), and the rates are the float schedule's to fp32 rounding."""
    assert schedulers_fill_tensor_rates()
    cfg = tiny_config("trainer.warmup_epochs=1").trainer
    rates = {}
    for kind in ("float", "tensor"):
        optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=cfg.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, 20, 5, cfg))
        if kind == "tensor":  # as rates_on_device does on CUDA, after the schedule is built
            optimizer.param_groups[0]["lr"] = captured = torch.tensor(optimizer.param_groups[0]["lr"])
        seen = []
        for _ in range(20):
            optimizer.step()
            schedule.step()
            seen.append(float(optimizer.param_groups[0]["lr"]))
        rates[kind] = seen
    assert optimizer.param_groups[0]["lr"] is captured
    assert rates["tensor"] == pytest.approx(rates["float"], rel=1e-6)


def test_the_run_says_which_backbone_and_weights_and_how_the_step_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    train(tiny_config("method=meat"), tmp_path)
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines at the terminal's width
    assert "backbone: vit_micro" in err and "random initialisation" in err
    assert "not a paper's backbone" in err and "experiment=meat_deit_small_paper" in err
    assert "runtime: cpu, fp32, torch.compile off, CUDA graphs off (the device is not CUDA)" in err
    saved = json.loads((tmp_path / "results.json").read_text())["acceleration"]
    assert saved == {
        "compile": False,
        "cuda_graphs": False,
        "compiled_graphs": 0,
        "compile_s": 0.0,
        "compile_failure": None,
    }
