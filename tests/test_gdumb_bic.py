"""GDumb and BiC (BASELINES.md §8, §9, §14) against independent transcriptions (tests/oracles/gdumb_bic_reference.py),
plus tiny end-to-end runs, a re-evaluation from the run folder and a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from clbench.config import MemoryConfig
from clbench.errors import ConfigError
from clbench.loop import task as task_module
from clbench.loop import train
from clbench.loop.runtime import build_runtime
from clbench.memory import Memory, herding
from clbench.methods.base import Phase
from clbench.methods.bic import BiC, distillation_weight
from clbench.methods.gdumb import GDumb
from clbench.reevaluate import reevaluate
from conftest import TINY, compose_config, crash_and_resume, tiny_config
from oracles import gdumb_bic_reference as ref

GDUMB = ("method=gdumb", "memory.per_class=4", "method.fit_epochs=2", "trainer.epochs=2")
BIC = ("method=bic", "memory.size=null", "memory.per_class=4", "method.bias_epochs=1", "trainer.epochs=2")


# ----------------------------------------------------------------------------- the memory's samplers
def feed_one_by_one(memory: Memory, labels: list[int]) -> list[tuple[tuple[int, int], ...]]:
    """Offer ``labels`` to the greedy sampler one image at a time (a stream in exactly this order); the per-class
    counts after each."""
    out = []
    for c in labels:
        y = torch.tensor([c])
        plan = memory.plan(None, y)  # type: ignore[arg-type]  # the greedy sampler needs no task
        memory.write(plan, torch.zeros((len(plan.rows()), 1, 1, 1), dtype=torch.uint8), y[plan.rows()], 0, first=0)
        counts = torch.bincount(memory.labels[: memory.capacity][memory.labels[: memory.capacity] >= 0], minlength=3)
        out.append(tuple((c, int(n)) for c, n in enumerate(counts.tolist()) if n))
    return out


def test_greedy_sampler_follows_the_trace_of_8_4() -> None:
    labels = [0, 0, 0, 0, 1, 1, 2]
    reachable = ref.greedy_reachable_counts(labels, 4)
    assert reachable[-1] == {((0, 1), (1, 2), (2, 1)), ((0, 2), (1, 1), (2, 1))}  # §8.4's two outcomes
    finals = set()
    for seed in range(12):
        torch.manual_seed(seed)
        memory = Memory(MemoryConfig(size=4), "greedy", num_classes=3, image_shape=(1, 1, 1))
        trace = feed_one_by_one(memory, labels)
        assert all(state in options for state, options in zip(trace, reachable, strict=True))
        assert trace[3] == ((0, 4),) and trace[4] == ((0, 3), (1, 1)) and trace[5] == ((0, 2), (1, 2))
        finals.add(trace[-1])
    assert finals == reachable[-1]  # the 0/1 tie is broken at random: both outcomes happen


@pytest.mark.parametrize("tasks", [1, 3])
def test_greedy_sampler_ends_balanced_like_the_offline_rule(tasks: int) -> None:
    """k = 12 over 3 classes of 10 images in a random stream (one task, or one class a task): ⌊k/C⌋ = 4 each."""
    for seed in range(5):
        torch.manual_seed(seed)
        memory = Memory(MemoryConfig(size=12), "greedy", num_classes=3, image_shape=(1, 1, 1))
        stream = torch.arange(3).repeat_interleave(10)
        parts = [stream] if tasks == 1 else list(stream.split(10))
        for labels in parts:
            plan = memory.plan(None, labels)  # type: ignore[arg-type]
            rows = plan.rows()
            memory.write(plan, torch.zeros((len(rows), 1, 1, 1), dtype=torch.uint8), labels[rows], 0, first=0)
        counts = torch.bincount(memory.labels[:12], minlength=3).tolist()
        assert counts == [ref.offline_per_class(12, 3)] * 3


def test_herding_picks_the_greedy_mean_matching_sequence() -> None:
    toy = [[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
    assert herding(torch.tensor(toy), 4).tolist() == ref.herding_reference(toy, 4)
    assert ref.herding_reference(toy, 2) == [3, 0]  # (1,1) is the mean's nearest; then (0,0) keeps (.5,.5) nearest
    g = torch.Generator().manual_seed(0)
    features = torch.randn(15, 2, generator=g, dtype=torch.float64)
    assert herding(features, 7).tolist() == ref.herding_reference(features.tolist(), 7)


# ----------------------------------------------------------------------------- BiC's rules
def test_bic_lambda() -> None:
    assert distillation_weight(30, 10) == ref.bic_lambda(30, 10) == 0.75


@pytest.fixture(scope="module")
def bic() -> BiC:
    """A BiC on TINY (3 tasks of 2 classes) taken to task 2 without training: teacher of tasks 0-1 built (online: the
    recorded teacher stores what the same ``teacher_logits`` gives)."""
    method, _ = build_runtime(tiny_config(*BIC, "method.teacher=online"))
    assert isinstance(method, BiC)
    for task in method.tasks:
        method.before_task(task)
        if task.id < 2:
            method.after_task(task)
    return method


def test_the_bias_layer_touches_only_the_newest_block(bic: BiC) -> None:
    task = bic.tasks[2]
    with torch.no_grad():
        bic.beta[2].fill_(2.0)
        bic.gamma[2].fill_(0.5)
        bic.beta[1].fill_(3.0)  # an earlier task's: never applied at test
        bic.gamma[1].fill_(-1.0)
    feats = torch.randn(5, bic.backbone.num_features)
    raw, corrected = bic.raw_seen_logits(feats), bic.seen_logits(feats)
    assert torch.equal(corrected[:, : task.offset], raw[:, : task.offset])
    torch.testing.assert_close(corrected, ref.bias_layer(raw, task.offset, 2.0, 0.5))
    # The bias stage's optimizer holds (β_2, γ_2) alone, and its loss gives nothing else a gradient.
    bic.before_phase(task, Phase("bias", 1, data="memory"))
    groups = bic.param_groups(task, Phase("bias", 1, data="memory"))
    assert [id(p) for g in groups for p in g["params"]] == [id(bic.beta[2]), id(bic.gamma[2])]
    x, y = torch.randn(6, 3, 16, 16), torch.tensor([0, 1, 2, 3, 4, 5])
    loss, _ = bic.training_loss(x, y, task)
    loss.backward()
    graded = {n for n, p in bic.named_parameters() if p.grad is not None}
    assert graded == {"beta.2", "gamma.2"}
    # γ penalty: CE of the corrected logits + 0.1·γ²/2.
    with torch.no_grad():
        logits = bic.raw_seen_logits(bic.features(x, 2))
    assert loss.item() == pytest.approx(ref.bias_stage_loss(logits, y, task.offset, 2.0, 0.5), rel=1e-5)
    bic.zero_grad(set_to_none=True)
    bic.before_phase(task, Phase("train", 1, data="task+memory"))


def test_distillation_uses_the_bias_corrected_teacher(bic: BiC) -> None:
    task = bic.tasks[2]
    bic.before_phase(task, Phase("train", 1, data="task+memory"))
    bic.param_groups(task, Phase("train", 1, data="task+memory"))
    with torch.no_grad():  # the student moves away from the teacher, task 1 gets a bias layer
        for p in bic.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
        bic.beta[1].fill_(1.7)
        bic.gamma[1].fill_(-2.0)
    bic.eval()
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 3, 4, 5])
    with torch.no_grad():
        loss, _ = bic.training_loss(x, y, task)
        student = bic.raw_seen_logits(bic.features(x, 2))
        teacher = torch.cat(bic.teacher.logits(x), 1)
    start = bic.tasks[1].offset  # the teacher's newest block: task 1's classes
    expected = ref.bic_stage1_loss(student, teacher, y, teacher_newest_start=start, beta=1.7, gamma=-2.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    uncorrected = ref.bic_stage1_loss(student, teacher, y, teacher_newest_start=start, beta=1.0, gamma=0.0)
    assert abs(uncorrected.item() - expected.item()) > 1e-3  # the correction is not a no-op here


@pytest.mark.parametrize("sampler", ["reservoir", "uniform", "greedy"])
def test_bic_refuses_a_sampler_that_holds_no_validation_images(sampler: str) -> None:
    """The bias stage trains on the validation images that herding (and balanced) hold out of each class; the other
    samplers hold none, which would leave (β, γ) untrained: refused before any work."""
    with pytest.raises(ConfigError, match=r"memory\.sampler.*herding or balanced"):
        tiny_config(*BIC, f"memory.sampler={sampler}")


def test_gdumb_refuses_cutmix() -> None:
    with pytest.raises(ConfigError, match="cutmix"):
        build_runtime(tiny_config(*GDUMB, "trainer.cutmix=1.0"))


@pytest.mark.parametrize(
    ("override", "match"),
    [("method.T=0", "method.T"), ("method.gamma_penalty=-1", "gamma_penalty"), ("method.bias_lr=.nan", "bias_lr")],
)
def test_bic_config_is_checked(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tiny_config(*BIC, override)


# ----------------------------------------------------------------------------- end to end
def test_gdumb_fits_on_the_memory_alone_from_the_pretrained_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start, _ = build_runtime(tiny_config(*GDUMB))  # the weights the run starts from: what every fit must start from
    initial = {k: v.clone() for k, v in start.backbone.state_dict().items()}
    fits: list[dict] = []
    real_before, real_data = GDumb.before_phase, task_module.phase_data

    def before_phase(self: GDumb, task, phase: Phase) -> None:
        trained = [h.weight.clone() for h in self.heads]
        real_before(self, task, phase)
        if phase.name == "fit":
            backbone = self.backbone.state_dict()
            fits.append(
                {
                    "reset": all(torch.equal(backbone[k], v) for k, v in initial.items()),
                    "heads_fresh": all(
                        not torch.equal(h.weight, w) for h, w in zip(self.heads[:-1], trained[:-1], strict=True)
                    ),
                }
            )

    def phase_data(method, phase, split, streamed_from=None):
        data = real_data(method, phase, split, streamed_from)
        if phase.name == "fit":
            held = method.memory.held_split()
            fits[-1]["memory_only"] = torch.equal(data.x, held.x) and torch.equal(data.y, held.y)
            fits[-1]["classes"] = sorted(set(data.y.tolist()))
        return data

    monkeypatch.setattr(GDumb, "before_phase", before_phase)
    monkeypatch.setattr(task_module, "phase_data", phase_data)
    results = train(tiny_config(*GDUMB), tmp_path)
    fits = [f for f in fits if "memory_only" in f]  # not the random-init probe's untrained lifecycle
    assert len(fits) == 3  # a fit after every task
    assert all(f["reset"] and f["heads_fresh"] and f["memory_only"] for f in fits)
    assert [f["classes"] for f in fits] == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["storage"]["memory"]["per_class_counts"] == [4] * 6  # 24 slots shared by the 6 classes at the end
    assert len(results.rows["cil"]) == 3


def test_bic_runs_and_evaluates_again_from_its_folder(tmp_path: Path) -> None:
    overrides = (*TINY, *BIC)
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_config(*overrides), tmp_path / ".hydra" / "config.yaml")
    train(tiny_config(*BIC), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["storage"]["memory"]["sampler"] == "herding"
    assert saved["storage"]["memory"]["per_class_counts"] == [4] * 6
    assert all(entry["bias"] == 64 for entry in saved["storage"]["bits_per_task"])
    beta, gamma = saved["bic"]["beta"], saved["bic"]["gamma"]
    assert beta[0] == 1.0 and gamma[0] == 0.0 and (beta[2], gamma[2]) != (1.0, 0.0)  # task 0 has no bias stage
    # The artifacts carry every (β, γ): clbench-eval gives the saved final row.
    assert reevaluate(tmp_path) == {s: saved["acc_matrix"][s][-1] for s in ("til", "cil")}


@pytest.mark.parametrize(
    ("overrides", "crash_at"),
    [
        pytest.param(GDUMB, 7, marks=pytest.mark.slow),  # task 1's fit, epoch 2: the replay resets the model first
        pytest.param((*BIC, "method.bias_epochs=2"), 16, marks=pytest.mark.slow),  # task 1's bias stage, epoch 2
        ((*BIC, "method.bias_epochs=2"), 21),  # task 2's stage 1, epoch 2: the teacher (and task 1's β, γ) restored
    ],
)
def test_a_resumed_run_ends_as_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...], crash_at: int
) -> None:
    """A crash mid-phase (after the phase's first epoch was checkpointed), then resume=true: the same results."""
    overrides = (*overrides, "trainer.checkpoint_every=1", "data.val_fraction=0.2")
    train(tiny_config(*overrides), tmp_path / "whole")
    expected = json.loads((tmp_path / "whole" / "results.json").read_text())["acc_matrix"]
    crash_and_resume(monkeypatch, overrides, tmp_path / "cut", crash_at)
    assert json.loads((tmp_path / "cut" / "results.json").read_text())["acc_matrix"] == expected


def test_the_loss_of_stage_one_on_task_zero_is_plain_cross_entropy() -> None:
    """No teacher, no memory: task 0 trains on its data with CE over its classes (λ = 0)."""
    fresh, _ = build_runtime(tiny_config(*BIC))
    task = fresh.tasks[0]
    fresh.before_task(task)
    assert [p.data for p in fresh.phases(task, 2)] == ["task", "task"]  # train, then the memory update
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 1, 0])
    fresh.eval()
    loss, _ = fresh.training_loss(x, y, task)
    assert loss.item() == pytest.approx(F.cross_entropy(fresh.seen_logits(fresh.features(x, 0)), y).item())


def test_gdumb_refuses_a_fit_of_no_epochs_however_it_is_asked_for() -> None:
    """fit_epochs=null takes trainer.epochs: with 0, GDumb's only training would not run and an untrained model's
    accuracy would be written as GDumb's (fit_epochs=0 itself is refused)."""
    with pytest.raises(ConfigError, match=r"`trainer\.epochs`: 0.*method\.fit_epochs"):
        tiny_config("method=gdumb", "method.fit_epochs=null", "trainer.epochs=0")
    with pytest.raises(ConfigError, match=r"`method\.fit_epochs`: 0"):
        tiny_config("method=gdumb", "method.fit_epochs=0")
    assert tiny_config("method=gdumb", "method.fit_epochs=3", "trainer.epochs=0").method.fit_epochs == 3


@pytest.mark.parametrize("sampler", ["reservoir", "uniform"])
def test_gdumb_refuses_a_sampler_that_fills_the_memory_in_training_steps(sampler: str) -> None:
    """GDumb takes no training step on a task's images (its fit trains on the memory alone), and the reservoir and
    uniform samplers store images during such steps: the fit would find the memory empty, at task 0."""
    with pytest.raises(ConfigError, match=rf"`memory\.sampler`: '{sampler}'.*greedy"):
        tiny_config(*GDUMB, f"memory.sampler={sampler}")
