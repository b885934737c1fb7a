"""The CUDA path (`make gpu-test`): every method's real training step and evaluation on one GPU.

At a ViT-S/16, 224 px shape, for every method: steps and an evaluation in bf16 autocast and in fp32, stepped as a run
steps (the whole step replayed as a CUDA graph); CUDA fp32 against CPU fp32 on the same weights and batch (logits and
one step's updates); bf16 finite and within a bound derived from bf16's precision and the size of the terms each logit
sums; fused attention (any fused SDPA backend) and no softmax of attention maps, from the profiler's operators; no
hidden host synchronisation in the eager step nor in a graph replay (``torch.cuda.set_sync_debug_mode("error")``). At
the micro ViT's shape: the compiled, graph-replayed step equal to the eager one (the schedule's rate changing at every
step), HAT's annealed s, MEAT's Gumbel noise, MIN's noise draws and the crops and flips fresh at every replay, a
failed capture stopping the run with the way out named; SLCA's alignment (a phase on drawn features) replayed as a
graph equal to eager, without a host sync. Then runs: a 1-process NCCL DDP run through torchrun; streamed batches
(data.store=stream) equal to held ones, and a streamed run's memory in pinned host memory that the step reads and
writes in place; the zero-forgetting methods' bit-exact TIL; a run killed mid-task resuming to the uninterrupted
run's results.

Marked ``gpu``: deselected by `make test`, skipped cleanly without CUDA. The CPU halves of the comparisons run in
the default suite (``test_the_cpu_reference_of_the_comparison_is_deterministic``; MIN's in ``make test-all``).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from clbench.config import validate
from clbench.data import Task
from clbench.errors import GraphCaptureError
from clbench.loop import step as step_module
from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import Runtime, build_runtime
from clbench.loop.step import WARMUP_STEPS, train_step
from clbench.loop.task import Hooks, PhaseRun, run_task
from clbench.methods import TRAINED, ctr, meat
from clbench.methods.base import Method, Phase
from clbench.methods.parts.bottleneck import Bottleneck
from clbench.methods.parts.pinoise import NoiseLayers
from conftest import TINY, attention_ops, clbench, compose_config, run_command, said, torchrun

METHODS = TRAINED
ZERO_FORGETTING = ("packnet", "piggyback", "supsup", "meat", "ksm", "tfm", "aper")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# ViT-S/16 at 224 px, random weights (no download on a GPU machine without network), synthetic 2-class tasks.
VIT_S = (
    "backbone=vit_small_patch16_224",
    "backbone.pretrained=false",
    "backbone.img_size=224",
    "data=synthetic_tiny",
    "data.num_tasks=2",
    "trainer.batch_size=8",
    "trainer.eval_batch_size=16",
    "trainer.lr_scale_batch=null",
    "trainer.warmup_epochs=0",
    "logger.mode=disabled",
)


# The micro ViT at its own shape (32 px, batch 32: the embedded default's), where compiling is quick.
MICRO = ("backbone=vit_micro", "data=synthetic_tiny", "trainer.batch_size=32", "logger.mode=disabled")
EAGER = ("trainer.compile=false", "trainer.cuda_graphs=false")
LR_BOUND = 0.1  # the largest default lr of any method (MEAT's mask lr): one step moves a weight by at most ~lr
BENCH_VIT_S = ("--backbone", "vit_small_patch16_224", "--image-size", "224", "--batch-size", "8")
BF16_UNIT = 2.0**-8  # bf16 keeps 8 significant bits: its unit roundoff


def deterministic_gumbel(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """MEAT's straight-through sample without noise: the same on every device, so CPU and CUDA steps compare."""
    soft = torch.sigmoid((logits[..., 0] - logits[..., 1]) / tau)
    return (soft > 0.5).to(soft.dtype) - soft.detach() + soft


def deterministic_gate(logits: torch.Tensor, sample: bool) -> torch.Tensor:
    """CTR's hard Gumbel gate without noise (the straight-through argmax), for the same reason."""
    return deterministic_gumbel(logits, 1.0)


def bottleneck_without_dropout(self: Bottleneck, x: torch.Tensor) -> torch.Tensor:
    """An adapter's bottleneck without its dropout (AdaptFormer's 0.1 in APER's and RanPAC's first session)."""
    return self.up(self.activation(self.down(x)))


def noise_without_draws(self: NoiseLayers, index: int, tokens: torch.Tensor) -> torch.Tensor:
    """MIN's Pi-Noise layer as its code computes it, mu + sigma, where the paper's reading draws xi."""
    return self.layers[index](tokens, self.omega)


def without_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The methods' Gumbel draws (MEAT's token masks, CTR's transfer gates) replaced by their noise-free samples,
    adapters' dropout and MIN's noise draws left out: the CPU and CUDA generators, and eager and compiled steps, draw
    differently."""
    monkeypatch.setattr(meat, "hard_gumbel_keep", deterministic_gumbel)
    monkeypatch.setattr(ctr, "hard_gate", deterministic_gate)
    monkeypatch.setattr(Bottleneck, "forward", bottleneck_without_dropout)
    monkeypatch.setattr(NoiseLayers, "noisy", noise_without_draws)


def comparable(key: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` without what no step determines: the key part of an attention's qkv bias. Softmax over the keys is
    shift-invariant and the key bias adds q·b_k to every logit of a query's row, so its exact gradient is 0; what a
    step does with it is rounding noise, which Adam scales to a full step of either sign (measured after 8 steps:
    11-14% of the key biases differ on the CPU, about 27% on an H100, and none of the queries' or values')."""
    if "attn.qkv.bias" not in key:
        return value
    third = value.shape[0] // 3
    return torch.cat([value[:third], value[2 * third :]])


def assert_states_agree(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Integer state equal; each float tensor equal to fp32 rounding in all but 0.1% of its entries (an entry whose
    gradient is a near-exact cancellation may take Adam's first step, about lr * sign(g), the other way)."""
    assert expected.keys() == got.keys()
    for key, full in expected.items():
        if not full.is_floating_point() or full.numel() == 0:
            assert torch.equal(got[key], full), key
            continue
        value, mine = comparable(key, full), comparable(key, got[key])
        close = torch.isclose(mine, value, rtol=1e-3, atol=1e-5)
        assert close.float().mean() >= 0.999, (key, (mine - value).abs().max())


def training_phase(method: Method, task: Task) -> Phase:
    """The task's first phase with gradient steps (MIN's comes after its observe passes)."""
    return next(p for p in method.phases(task, 1) if not (p.observe or p.memory))


def start_training(method: Method, task: Task) -> Phase:
    """The task started up to its first training phase, as the loop starts each phase before it (without data)."""
    phase = training_phase(method, task)
    for earlier in method.phases(task, 1):
        method.before_phase(task, earlier)
        if earlier == phase:
            return phase
    raise AssertionError("unreachable")


def prepared(method_name: str, device: str, precision: str = "fp32") -> tuple[Method, Runtime]:
    """A method with its first task started up to its first training phase, built with seed 0 on ``device``."""
    overrides = (f"method={method_name}", f"trainer.device={device}", f"trainer.precision={precision}")
    cfg = validate(compose_config(*VIT_S, *overrides, "trainer.compile=false"))
    method, rt = build_runtime(cfg)
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    start_training(method, task)
    return method, rt


def one_step(method: Method, rt: Runtime, x_raw: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One real training step (the loop's train_step) on a fixed batch with the test-time transform."""
    task = rt.benchmark.tasks[0]
    optimizer = build_optimizer(method, task, training_phase(method, task), rt.cfg.trainer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    method.train()
    method.before_step(task, 0, 1)
    rt.train_tf = rt.test_tf  # no random augmentation: both devices see the same pixels
    loss, _ = train_step(method, task, rt, x_raw, y, optimizer=optimizer, params=params)
    return loss


def phase_stepper(method_name: str, *overrides: str) -> tuple[Method, Runtime, PhaseRun, Task]:
    """A method with its first phase started as the loop starts it (optimizer, schedule, learning-rate tensors, the
    phase's stepper), on CUDA."""
    cfg = validate(compose_config(f"method={method_name}", "trainer.device=cuda", *overrides))
    method, rt = build_runtime(cfg)
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    phase = start_training(method, task)
    method.train()
    return method, rt, PhaseRun(method, task, phase, 0, split=rt.benchmark.train[0], rt=rt, hooks=Hooks()), task


def state(method: Method) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in method.state_dict().items() if isinstance(v, torch.Tensor)}


def cpu_reference(method_name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Method, dict[str, torch.Tensor]]:
    """The CPU half of the CUDA comparison: the method before its step (eval logits come from it) and its state after
    one real step on the first batch (Gumbel draws replaced by noise-free samples on both devices)."""
    without_noise(monkeypatch)
    method, rt = prepared(method_name, "cpu")
    start = copy.deepcopy(method)
    one_step(method, rt, *rt.benchmark.train[0].batch(None, 0, 8))
    return start, state(method)


@contextmanager
def strict_fp32() -> Iterator[None]:
    """No TF32 in matmuls or convolutions: fp32 on CUDA is then comparable with fp32 on CPU."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize(  # MEAT in the default suite, the others (6-7 s each) in make test-all
    "method_name", ["meat", *(pytest.param(m, marks=pytest.mark.slow) for m in ("l2p", "ctr", "min"))]
)
def test_the_cpu_reference_of_the_comparison_is_deterministic(
    method_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs without a GPU: the CPU side of the CUDA-vs-CPU check gives the same state twice (to fp32 rounding: L2P's
    prompt gradient is a scatter-add over the samples that chose a prompt, summed in thread order), so a mismatch on
    a GPU beyond that is the GPU's."""
    _, first = cpu_reference(method_name, monkeypatch)
    _, second = cpu_reference(method_name, monkeypatch)
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], msg=key)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("method_name", METHODS)
def test_steps_and_evaluation_run_on_cuda(method_name: str, precision: str) -> None:
    """A whole phase as a run takes it: warm-up steps, capture, replays, the epoch's last (smaller) batch eagerly."""
    method, rt = prepared(method_name, "cuda", precision)
    task = rt.benchmark.tasks[0]
    run_task(method, task, rt, epochs=1)
    method.after_task(task)
    assert rt.accel.graphs  # captured and replayed (a failed capture would have raised)
    accuracy = rt.evaluate(method, [0]).accuracy
    assert all(0 <= a <= 100 for values in accuracy.values() for a in values)
    assert all(torch.isfinite(p).all() for p in method.parameters())


def logit_terms(method: Method, x: torch.Tensor, task_id: int) -> torch.Tensor:
    """Per logit, the sum of the magnitudes of the terms it adds up: |features| @ |W|^T + |b| of the task's head."""
    head = method.heads[task_id]
    feats = method.features(x, task_id)
    return feats.abs() @ head.weight.abs().T + head.bias.abs()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method_name", METHODS)
def test_cuda_fp32_matches_cpu_fp32_and_bf16_stays_close(method_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same weights, same batch: the logits and one step's updated state agree within fp32 rounding (rtol 1e-3,
    TF32 off; the fused CUDA AdamW against the CPU one). bf16 autocast logits are finite and each within 8u S of fp32's,
    u = 2^-8 bf16's unit roundoff and S the sum of the magnitudes of the terms the logit adds up: each term carries
    the rounding of its two bf16 operands (2u) and the bf16 activations of the backbone a few u more; 8u leaves a
    factor 2. (A bound scaled by the logits themselves fails where they cancel to near 0, as at a random init.)"""
    start, after_cpu = cpu_reference(method_name, monkeypatch)
    on_gpu, rt = prepared(method_name, "cuda")
    on_gpu.load_state_dict(state(start))
    x_raw, y = rt.benchmark.train[0].batch(None, 0, 8)
    x = rt.test_tf(x_raw)
    with torch.no_grad():
        logits_cpu = start.eval().predict(x.cpu(), 0)
        terms = logit_terms(start, x.cpu(), 0)
    with strict_fp32(), torch.no_grad():
        logits_gpu = on_gpu.eval().predict(x, 0).cpu()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits_bf16 = on_gpu.predict(x, 0).float().cpu()
    scale = float(logits_cpu.abs().max().clamp_min(1e-3))
    torch.testing.assert_close(logits_gpu, logits_cpu, rtol=1e-3, atol=1e-4 * scale)
    assert torch.isfinite(logits_bf16).all()
    excess = (logits_bf16 - logits_cpu).abs() - 8 * BF16_UNIT * terms
    assert excess.max() <= 0, ((logits_bf16 - logits_cpu).abs().max(), terms.max())
    with strict_fp32():
        one_step(on_gpu, rt, x_raw, y)
    after_gpu = state(on_gpu)
    assert_states_agree(after_cpu, after_gpu)
    for key, value in after_cpu.items():  # and none differs by more than a step
        if value.is_floating_point() and value.numel():
            assert (after_gpu[key] - value).abs().max() <= 2 * max(LR_BOUND, 1e-5) + 1e-3 * value.abs().max(), key


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method_name", METHODS)
def test_attention_runs_fused_on_cuda_without_attention_softmax(method_name: str) -> None:
    """The eager step's operators (a compiled step or a graph replay hides them): SDPA on a fused backend."""
    from clbench.bench.cli import parse
    from clbench.bench.models import method_step

    args = parse([*BENCH_VIT_S, "--device", "cuda", "--compile", "false", "--cuda-graphs", "false"])
    fused, softmax = attention_ops(method_step(args, method_name).step, cuda=True)
    assert fused and not softmax, softmax


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("method_name", METHODS)
def test_the_step_makes_no_hidden_host_sync(method_name: str, graphs: bool) -> None:
    """Outside the log step the loop never waits for the GPU: a sync in the eager step, or in a graph's replay with
    its input copies and learning-rate updates, raises under debug mode "error". (A sync inside the captured step
    would have failed the capture.)"""
    method, rt, run, task = phase_stepper(
        method_name, *VIT_S, "trainer.compile=false", f"trainer.cuda_graphs={str(graphs).lower()}"
    )
    split = rt.benchmark.train[0]

    def step() -> None:  # what the loop does per batch
        x, y = split.batch(None, 0, 8)
        method.before_step(task, 0, 4)
        _, logs = run.stepper(x, y)
        run.diagnostics.add(logs)  # the method's logged values, summed on the device
        run.schedule.step()

    for _ in range(WARMUP_STEPS + 1 if graphs else 1):  # warm-up (and capture): allocations, lazy initialisation
        step()
    assert (run.stepper.graph is not None) == graphs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def deterministic(monkeypatch: pytest.MonkeyPatch, rt: Runtime) -> None:
    """No random draw in the step: the test transform for training and the noise-free Gumbel samples."""
    without_noise(monkeypatch)
    rt.train_tf = rt.test_tf


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method_name", METHODS)
def test_the_compiled_graph_step_equals_the_eager_step(method_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.compile=true + cuda_graphs=true (the CUDA default) against eager, fp32, TF32 off, no random draws, on
    the same batches: warm-up, capture, replays and an epoch's smaller last batch leave the same parameters to fp32
    rounding (the compiled kernels sum in another order). The compiled step really compiled, the graph was captured."""
    from torch._dynamo.utils import counters

    runs = {}
    for mode in ("eager", "accelerated"):
        chosen = EAGER if mode == "eager" else ("trainer.compile=true", "trainer.cuda_graphs=true")
        method, rt, run, task = phase_stepper(
            method_name, *MICRO, "data.synthetic_train_per_class=50", "trainer.precision=fp32", *chosen
        )
        stepper = run.stepper
        deterministic(monkeypatch, rt)
        before = counters["stats"]["unique_graphs"]
        split = rt.benchmark.train[0]  # 100 images: three batches of 32 and one of 4
        per_epoch = split.num_batches(32)
        assert (len(split), per_epoch) == (100, 4)
        with strict_fp32():  # warm, warm, capture + replay, eager; then replays and an eager batch again
            for b in range(2 * per_epoch):
                method.before_step(task, b % per_epoch, per_epoch)
                stepper(*split.batch(None, b % per_epoch, 32))
                run.schedule.step()  # the cosine schedule: every replay must read the rate written before it
        torch.cuda.synchronize()
        if mode == "accelerated":
            assert stepper.graph is not None and counters["stats"]["unique_graphs"] > before
        runs[mode] = state(method)
    assert_states_agree(runs["eager"], runs["accelerated"])


@pytest.mark.gpu
@needs_cuda
def test_each_replay_reads_hats_s_and_draws_fresh_noise() -> None:
    """HAT's annealed s is read by every replay (its capacity term is that of the s before_step wrote), and MEAT's
    Gumbel masks (uniform init: keep probabilities far from 0 and 1) differ from replay to replay."""
    method, rt, run, task = phase_stepper("hat", *MICRO, "trainer.compile=false")
    stepper = run.stepper
    x, y = rt.benchmark.train[0].batch(None, 0, 32)
    for b in range(WARMUP_STEPS + 4):
        method.before_step(task, b, 8)
        embeddings = {k: e.detach().clone() for k, e in method.embeddings[0].items()}
        _, logs = stepper(x, y)
        s = torch.tensor(annealed(b))
        expected = torch.cat([torch.sigmoid(s * e) for e in embeddings.values()]).mean()  # R with a^{<0} = 0
        torch.testing.assert_close(logs["capacity_reg"], expected.to(logs["capacity_reg"]), rtol=1e-4, atol=1e-6)
    assert stepper.graph is not None
    _, rt, run, _ = phase_stepper("meat", *MICRO, "trainer.compile=false", "method.init=uniform")
    stepper = run.stepper
    x, y = rt.benchmark.train[0].batch(None, 0, 32)
    ratios = [float(stepper(x, y)[1]["token_keep_ratio"]) for _ in range(WARMUP_STEPS + 4)]
    assert stepper.graph is not None and len(set(ratios[WARMUP_STEPS:])) > 1, ratios


@pytest.mark.gpu
@needs_cuda
def test_each_replay_draws_mins_noise_afresh() -> None:
    """MIN's paper reading draws xi inside the captured step: with the learning rate near 0, no augmentation and a
    generator that makes noise, one batch's loss changes from replay to replay only through the draws."""
    overrides = ("trainer.compile=false", "trainer.lr=1e-12", "data.train_crop=none", "data.hflip=false")
    method, rt, run, _ = phase_stepper("min", *MICRO, *overrides)
    with torch.no_grad():
        for p in method.noise.newest():
            p.normal_(std=0.1)
    x, y = rt.benchmark.train[0].batch(None, 0, 32)
    losses = [float(run.stepper(x, y)[0]) for _ in range(WARMUP_STEPS + 4)]
    assert run.stepper.graph is not None and len(set(losses[WARMUP_STEPS:])) > 1, losses


def annealed(batch: int) -> float:
    from clbench.methods.hat import annealed_s

    return annealed_s(batch, 8, 400.0)


@pytest.mark.gpu
@needs_cuda
def test_a_failed_capture_is_an_error_that_names_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails leaves CUDA's allocator and streams unsafe: the run stops with trainer.cuda_graphs=false
    as the way out, instead of going on."""

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(step_module, "StepGraph", refuse)
    _, rt, run, _ = phase_stepper("finetune", *MICRO, "trainer.compile=false")
    x, y = rt.benchmark.train[0].batch(None, 0, 32)
    for _ in range(WARMUP_STEPS):
        run.stepper(x, y)
    with pytest.raises(GraphCaptureError, match=r"could not be captured.*trainer\.cuda_graphs=false"):
        run.stepper(x, y)


@pytest.mark.gpu
@needs_cuda
def test_each_replay_draws_its_own_augmentation() -> None:
    """Pad-and-crop and flips inside the graph: with the learning rate at 0 nothing trains, so the loss of one batch
    replayed changes only because each replay draws new crops and flips."""
    _, rt, run, _ = phase_stepper(
        "finetune", *MICRO, "trainer.compile=false", "data.train_crop=pad", "data.hflip=true", "trainer.lr=1e-12"
    )
    x, y = rt.benchmark.train[0].batch(None, 0, 32)
    losses = [float(run.stepper(x, y)[0]) for _ in range(WARMUP_STEPS + 4)]
    assert run.stepper.graph is not None and len(set(losses[WARMUP_STEPS:])) > 1, losses


def slca_before_alignment() -> tuple[Method, Runtime, Task, Phase]:
    """SLCA at the micro ViT's shape on CUDA, fp32, without random augmentation, trained eagerly through task 1's
    statistics, and its alignment phase (SLCA's: 5 epochs of 4 classes x 256 drawn samples in batches of 256)
    started."""
    overrides = ("method=slca", *MICRO, "data.num_tasks=2", "trainer.precision=fp32", *EAGER)
    method, rt = build_runtime(validate(compose_config(*overrides, "method.alignment.epochs=0", "trainer.device=cuda")))
    rt.train_tf = rt.test_tf
    for task in rt.benchmark.tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=2)  # no alignment phase (alignment.epochs=0): it is built below
        if task.id == 0:
            method.after_task(task)
    align = Phase("align", 5, data="features", trainer=method.aligner.trainer_settings())
    method.before_phase(task, align)
    return method, rt, task, align


@pytest.mark.gpu
@needs_cuda
def test_the_alignment_phase_replays_as_one_graph_equal_to_its_eager_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLCA's classifier alignment reads no image: from the same start, its steps (drawn features, the heads alone, SGD
    with a cosine stepped per epoch) compiled and captured once, then replayed, leave the heads of the eager steps to
    fp32 rounding."""
    from clbench.loop.runtime import Acceleration

    captures = []
    real = step_module.StepGraph

    def counting(*args, **kwargs):
        captures.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "StepGraph", counting)
    method, rt, task, align = slca_before_alignment()
    states = {}
    for mode, accel in (("eager", Acceleration(False, False, "eager")), ("accelerated", Acceleration(True, True))):
        aligned, rt.accel = copy.deepcopy(method), accel
        torch.manual_seed(0)  # the same draws and epoch orders for both
        with strict_fp32():
            PhaseRun(aligned, task, align, 2, split=None, rt=rt, hooks=Hooks()).epochs(0)
        states[mode] = state(aligned)
    assert len(captures) == 1
    assert not torch.equal(states["eager"]["heads.0.weight"], state(method)["heads.0.weight"])  # the heads moved
    assert_states_agree(states["eager"], states["accelerated"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_the_alignment_step_makes_no_hidden_host_sync(graphs: bool) -> None:
    from clbench.loop.runtime import Acceleration

    method, rt, task, align = slca_before_alignment()
    rt.accel = Acceleration(False, graphs, None if graphs else "eager")
    run = PhaseRun(method, task, align, 2, split=None, rt=rt, hooks=Hooks())
    x, y = run.split.batch(None, 0, 256)

    def step() -> None:  # what the loop does per batch
        run.stepper(x, y)
        run.schedule.step()

    for _ in range(WARMUP_STEPS + 1 if graphs else 1):
        step()
    assert (run.stepper.graph is not None) == graphs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
def test_one_process_nccl_ddp_equals_the_plain_run(tmp_path: Path) -> None:
    overrides = (*TINY, "method=meat", "trainer.device=cuda", "logger.mode=disabled")
    plain = clbench(*overrides, f"hydra.run.dir={tmp_path / 'plain'}", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    ddp = torchrun(1, *overrides, f"hydra.run.dir={tmp_path / 'ddp'}", cwd=tmp_path)
    assert ddp.returncode == 0, said(ddp)
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("plain", "ddp"))
    assert b["status"] == "finished" and a["acc_matrix"] == b["acc_matrix"]


@pytest.mark.gpu
@needs_cuda
def test_streamed_batches_reach_the_gpu_equal_to_the_device_store(tmp_path: Path) -> None:
    """data.store=stream on CUDA: batches read by workers into pinned memory and copied on a side stream equal the
    device store's, and a whole run gives the device store's accuracy matrices."""
    from clbench.data import build_benchmark

    cfg = validate(compose_config(*TINY, f"data.cache_dir={tmp_path / 'cache'}", "data.stream_workers=2"))
    held = build_benchmark(cfg.data, torch.device("cuda"))
    streamed = build_benchmark(replace(cfg.data, store="stream"), torch.device("cuda"))
    for a, b in zip(held.train, streamed.train, strict=True):
        order = a.permutation()
        for (xa, _), (xb, yb) in zip(a.batches(7, order=order), b.batches(7, order=order), strict=True):
            assert xb.is_cuda and yb.is_cuda and torch.equal(xa, xb)
    overrides = (*TINY, "method=meat", "trainer.device=cuda", f"data.cache_dir={tmp_path / 'cache'}")
    for store in ("device", "stream"):
        out = clbench(*overrides, f"data.store={store}", f"hydra.run.dir={tmp_path / store}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("device", "stream"))
    assert a["acc_matrix"] == b["acc_matrix"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("method_name", ["er", "derpp"])
def test_a_streamed_runs_memory_is_pinned_host_memory_the_step_reads_in_place(
    method_name: str, graphs: bool, tmp_path: Path
) -> None:
    """data.store=stream: the memory's images are pinned host memory that the step's kernels address in place (the
    reservoir's writes land in the host tensor, no GPU copy of the memory), without a host sync in the eager step or
    the graph's replay; the checkpoint holds the host tensor, and loading it into a fresh memory restores it."""
    stream = ("data.store=stream", f"data.cache_dir={tmp_path}", "trainer.compile=false")
    method, rt, run, task = phase_stepper(method_name, *VIT_S, *stream, f"trainer.cuda_graphs={str(graphs).lower()}")
    memory = method.memory
    assert memory is not None and memory.host is not None and memory.host.is_pinned()
    assert memory.images.is_cuda and memory.images.data_ptr() == memory.host.data_ptr()
    x, y = rt.benchmark.train[0].batch(None, 0, 8)  # read from the cache before the checked steps

    def step() -> None:
        method.before_step(task, 0, 4)
        run.stepper(x, y)
        run.schedule.step()

    for _ in range(WARMUP_STEPS + 1 if graphs else 1):
        step()
    torch.cuda.synchronize()
    assert torch.equal(memory.host[:8], x.cpu())  # the first images offered fill the first slots, in the host tensor
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # replays from the memory, and offers the batch to it
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    saved = memory.state_dict()
    assert saved["images"].device.type == "cpu"
    fresh, _ = build_runtime(validate(compose_config(f"method={method_name}", "trainer.device=cuda", *VIT_S, *stream)))
    fresh.memory.load_state_dict(saved)
    assert fresh.memory.host is not None and torch.equal(fresh.memory.host, memory.host)


@pytest.mark.gpu
@needs_cuda
def test_a_run_replaying_from_pinned_host_memory_gives_the_device_stores_numbers(tmp_path: Path) -> None:
    """DER++ and BiC streamed on CUDA (the memory in pinned host memory; BiC's first stage streaming the memory's
    images from the cache) against the device store: the same accuracy matrices and memory."""
    for method in ("derpp", "bic"):
        overrides = (*TINY, f"method={method}", "trainer.device=cuda", f"data.cache_dir={tmp_path / 'cache'}")
        for store in ("device", "stream"):
            folder = f"hydra.run.dir={tmp_path / method / store}"
            out = clbench(*overrides, f"data.store={store}", folder, cwd=tmp_path)
            assert out.returncode == 0, out.stderr[-3000:]
        a, b = (json.loads((tmp_path / method / s / "results.json").read_text()) for s in ("device", "stream"))
        assert a["acc_matrix"] == b["acc_matrix"], method
        assert b["storage"]["memory"]["held_in"].startswith("pinned host memory")
        assert {**a["storage"]["memory"], "held_in": None} == {**b["storage"]["memory"], "held_in": None}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method_name", ZERO_FORGETTING)
def test_zero_forgetting_methods_keep_old_tasks_bit_exact_on_cuda(method_name: str) -> None:
    """Trained as a CUDA run trains (compiled, graph-replayed steps): task 0's logits never change."""
    cfg = validate(compose_config(*TINY, f"method={method_name}", "trainer.device=cuda"))
    method, rt = build_runtime(cfg)
    assert rt.accel.compile and rt.accel.graphs
    x = rt.test_tf(rt.benchmark.test[0].x)
    first: torch.Tensor | None = None
    for task in rt.benchmark.tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
        method.eval()
        logits = method.predict(x, 0)
        first = logits if first is None else first
        assert torch.equal(logits, first), task.id


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_run_killed_mid_task_resumes_to_the_uninterrupted_results(tmp_path: Path) -> None:
    """SIGKILL after a mid-task checkpoint, then resume=true: the CUDA run (compiled, graph-replayed) ends with the
    matrices of the run that was never stopped (RNG state, optimizer state and learning-rate tensors restored)."""
    from test_resume import CHECKPOINTED, clbench_killing_itself, matrices

    overrides = (*TINY, *CHECKPOINTED, "method=meat", "trainer.device=cuda", "logger.mode=disabled")
    whole = clbench(*overrides, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = clbench_killing_itself(tmp_path / "resumed", "KILL", 4, *overrides)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = clbench(*overrides, "resume=true", f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert matrices(tmp_path / "resumed" / "results.json") == matrices(tmp_path / "whole" / "results.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_cuda_the_gpu_suite_skips_cleanly_and_gpu_check_says_why(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    suite = run_command(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", __file__, cwd=root)
    assert suite.returncode == 0, suite.stdout[-2000:]
    assert "passed" not in suite.stdout and " skipped" in suite.stdout  # collected, every one skipped
    targets = ("gpu-test-steps", "gpu-test-runs", "gpu-bench", "gpu-bench-micro", "gpu-l2p", "gpu-window")
    for target in targets:  # each checks first
        first_line = run_command("make", "-n", "--no-print-directory", target, cwd=root).stdout.splitlines()[0]
        assert "torch.cuda.is_available()" in first_line and f"make {target} needs a CUDA GPU" in first_line
    for target, first in (("gpu-check", "gpu-test-steps"), ("gpu-bench-micro", "gpu-bench-micro")):  # and says why
        make = run_command("make", "-s", target, f"GPU_PY={sys.executable}", cwd=root)
        assert make.returncode != 0 and f"make {first} needs a CUDA GPU" in make.stderr


def test_gpu_check_without_the_venv_says_to_install_it_or_pass_gpu_py(tmp_path: Path) -> None:
    """On a fresh clone (no .venv) `make gpu-check` said `.venv/bin/python: not found`."""
    root = Path(__file__).resolve().parents[1]
    make = run_command("make", "-s", "gpu-check", f"VENV={tmp_path / 'none'}", cwd=root)
    assert make.returncode != 0 and "not found" not in make.stderr, make.stderr
    assert f"no Python at GPU_PY={tmp_path / 'none'}/bin/python: run make install first" in make.stderr
    assert "or pass GPU_PY=python3" in make.stderr
