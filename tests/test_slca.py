"""SLCA and the Gaussian classifier alignment part: each rule against an independent transcription of the official code
(tests/oracles/slca_reference.py, GengDavid/SLCA@169d4e6) on small tensors, and the alignment's ``features`` phase
through the loop (the official stage 2 number for number, its draws, the heads' recall, resume, clbench-eval)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from clbench.data import Split, Task
from clbench.loop import train
from clbench.loop.optim import build_optimizer, lr_factor
from clbench.loop.resume import finish_untrained
from clbench.loop.runtime import build_runtime
from clbench.loop.step import train_step
from clbench.loop.task import run_task
from clbench.methods.parts import gaussian_alignment as ga
from clbench.methods.slca import SLCA
from clbench.reevaluate import reevaluate
from conftest import TINY, compose_config, crash_and_resume, tiny_config
from oracles import slca_reference as ref

# Small draws so that the official code's pairing of one class's worth of samples with one step holds (batch =
# samples a class), and the alignment runs in a fraction of a second.
SMALL = ("method=slca", "method.alignment.samples_per_class=8", "method.alignment.batch_size=8")


def aligner(dim: int, **options: object) -> ga.GaussianAligner:
    return ga.GaussianAligner(ga.AlignmentConfig(**options), dim)  # type: ignore[arg-type]


def observed(values: torch.Tensor, labels: torch.Tensor, **options: object) -> ga.GaussianAligner:
    """An aligner with one task of ``labels.max() + 1`` classes, observed in batches of 5 and settled."""
    part = aligner(values.shape[1], **options)
    part.add_task(torch.nn.Linear(values.shape[1], int(labels.max()) + 1))
    part.start()
    for lo in range(0, len(labels), 5):
        part.observe(values[lo : lo + 5], labels[lo : lo + 5])
    part.settle()
    return part


# ----------------------------------------------------------------------------- statistics and draws
def test_class_moments_from_fp64_sums_are_the_codes_torch_cov_plus_ridge() -> None:
    gen = torch.Generator().manual_seed(0)
    values = 3 + 2 * torch.randn(23, 6, generator=gen)
    labels = torch.tensor([0] * 13 + [1] * 10)[torch.randperm(23, generator=gen)]
    part = observed(values, labels)
    block = part.tasks[0]
    for c in range(2):
        mean, cov = ref.class_statistics(values[labels == c].numpy())
        torch.testing.assert_close(block.mean[c].double(), torch.from_numpy(mean).double(), rtol=1e-6, atol=1e-6)
        factor = block.factor[c].double()
        torch.testing.assert_close(factor @ factor.T, cov, rtol=1e-5, atol=1e-6)
        assert torch.equal(factor, factor.tril())  # a Cholesky factor
    diagonal = observed(values, labels, covariance="diagonal").tasks[0]
    for c in range(2):
        _, cov = ref.class_statistics(values[labels == c].numpy())
        torch.testing.assert_close(diagonal.factor[c].double().square(), cov.diagonal(), rtol=1e-5, atol=1e-6)


def test_a_class_with_one_image_gets_the_ridge_alone_not_nan() -> None:
    part = observed(torch.ones(3, 4), torch.tensor([0, 1, 1]))
    assert torch.allclose(part.tasks[0].factor[0], math.sqrt(1e-4) * torch.eye(4))


def test_samples_have_their_classs_mean_and_covariance() -> None:
    """10^5 samples of a class: empirical mean and covariance within a few standard errors of (mu, Sigma)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4, 4, generator=gen)
    sigma, mu = a @ a.T + 0.5 * torch.eye(4), torch.tensor([1.0, -2.0, 0.5, 3.0])
    part = aligner(4, samples_per_class=100_000, mean_shrink="none")
    part.add_task(torch.nn.Linear(4, 1))
    part.tasks[0].mean.copy_(mu[None])
    part.tasks[0].factor.copy_(torch.linalg.cholesky(sigma)[None])
    x = part.draw([Task(0, (0,), ("a",), 0)], 0, epoch=0).x.double()
    assert torch.allclose(x.mean(0), mu.double(), atol=4 * math.sqrt(sigma.diagonal().max() / 1e5))
    s = sigma.double()  # a sample covariance's standard error: sqrt((s_ii s_jj + s_ij^2) / n)
    error = ((s.diagonal()[:, None] * s.diagonal()[None, :] + s.square()) / 1e5).sqrt()
    assert ((torch.cov(x.T) - s).abs() <= 5 * error).all()


def test_a_draw_depends_on_the_run_seed_task_and_epoch_alone() -> None:
    cfg = tiny_config(*SMALL)
    method, rt = build_runtime(cfg)
    tasks = rt.benchmark.tasks
    for task in tasks[:2]:
        method.before_task(task)
        finish_untrained(method, task)
    first = method.drawn_split(tasks[1], None, 3)  # type: ignore[arg-type]
    torch.rand(100)  # the run's stream moves on: the draw does not follow it
    again = method.drawn_split(tasks[1], None, 3)  # type: ignore[arg-type]
    assert torch.equal(first.x, again.x) and torch.equal(first.y, again.y)
    assert not torch.equal(method.drawn_split(tasks[1], None, 4).x, first.x)  # type: ignore[arg-type]
    torch.manual_seed(cfg.seed + 1)  # another run seed, another draw
    assert not torch.equal(method.drawn_split(tasks[1], None, 3).x, first.x)  # type: ignore[arg-type]
    assert first.y.tolist() == [c for c in range(4) for _ in range(8)]  # class order, 8 a class


def test_steps_all_use_every_sample_and_steps_old_one_batch_per_old_class() -> None:
    """Three tasks of one class at stage 2, 5 samples a class, batch 4: all -> 15 samples (4 steps); old -> 2 old
    classes -> 2 steps of 4 out of the 15 drawn (HiDe's rule)."""
    tasks = [Task(t, (t,), (str(t),), t) for t in range(3)]
    for steps, size in (("all", 15), ("old", 8)):
        part = aligner(3, samples_per_class=5, batch_size=4, steps=steps)
        for _ in tasks:
            part.add_task(torch.nn.Linear(3, 1))
        drawn = part.draw(tasks, 2, epoch=0)
        assert len(drawn) == size and drawn.num_batches(4) == size // 4 + (size % 4 > 0)


def test_mean_shrink_slca_and_tuna_codes_factors() -> None:
    """SLCA (slca.py L199-201): class of task k at stage t gets 0.9 + 0.1 (k + 1) / (t + 1), task 0 at t = 9 -> 0.91,
    the current task 1.0. TUNA's code (PTM.md part 2 §2.7-6): inc 20, t = 9 -> 0.91, 0.90, 0.89, 0.81."""
    classes = torch.arange(100)
    slca = ga.shrink_factors(classes, classes // 10, 9, 10, "slca")
    assert slca.tolist() == pytest.approx([ref.mean_factor(c, 10, 9) for c in range(100)])
    assert slca[0].item() == pytest.approx(0.91) and slca[99].item() == pytest.approx(1.0)
    tuna = ga.shrink_factors(torch.tensor([0, 5, 25, 185]), torch.zeros(4), 9, 20, "tuna_code")
    assert tuna.tolist() == pytest.approx([0.91, 0.90, 0.89, 0.81])
    assert ga.shrink_factors(classes, classes // 10, 9, 10, "none").tolist() == [1.0] * 100


def test_the_logit_normalised_loss_is_the_codes_and_a_hand_value() -> None:
    """Two tasks of two classes, tau = 0.1: z = (1, 0 | 0, 2) has block norms 1 and 2, mean 1.5 (+1e-7)."""
    z = torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    part = aligner(2)
    got = part.loss(z, torch.tensor([0]), [2, 2])
    scaled = [v / (1.5 + 1e-7) / 0.1 for v in (1.0, 0.0, 0.0, 2.0)]
    hand = -scaled[0] + math.log(sum(math.exp(v) for v in scaled))
    assert got.item() == pytest.approx(hand, rel=1e-6)
    gen = torch.Generator().manual_seed(2)
    logits, y = torch.randn(7, 5, generator=gen), torch.randint(0, 5, (7,), generator=gen)
    for tau in (0.1, None):
        official = ref.ca_loss(logits, y, [2, 3], 1, tau)
        torch.testing.assert_close(aligner(2, logit_norm=tau).loss(logits, y, [2, 3]), official)


# ----------------------------------------------------------------------------- the schedules the recipes use
def test_multistep_and_per_epoch_cosine_follow_torchs_schedulers_stepped_per_epoch() -> None:
    """The official stage 1 steps MultiStepLR([18], 0.1) once an epoch, stage 2 CosineAnnealingLR(T_max=5); TUNA's code
    T_max = 5 over 30 epochs (periodic). Three steps an epoch: each step's factor is its epoch's."""
    cfg = tiny_config().trainer
    cases = [
        (
            {"schedule": "multistep", "milestones": [18], "lr_decay": 0.1},
            20,
            lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [18], 0.1),
        ),
        (
            {"schedule": "cosine", "schedule_steps": "epoch"},
            5,
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 5),
        ),
        (
            {"schedule": "cosine", "schedule_steps": "epoch", "cosine_epochs": 5},
            30,
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 5),
        ),
    ]
    import dataclasses

    for settings, epochs, official in cases:
        trainer = dataclasses.replace(cfg, lr=1.0, **settings)
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        schedule = official(optimizer)
        for epoch in range(epochs):
            expected = optimizer.param_groups[0]["lr"]
            for step in range(3 * epoch, 3 * epoch + 3):
                assert lr_factor(step, 3 * epochs, 0, trainer, 3) == pytest.approx(expected, abs=1e-12), (
                    settings,
                    epoch,
                )
            optimizer.step()
            schedule.step()


# ----------------------------------------------------------------------------- the method through the loop
def started(*overrides: str) -> tuple[SLCA, object]:
    method, rt = build_runtime(tiny_config(*SMALL, *overrides))
    assert isinstance(method, SLCA)
    return method, rt


def test_the_slow_learners_steps_are_the_codes() -> None:
    """Task 1's first two steps (momentum in play) against slca.py's optimizer: backbone at 0.01 x the head's lr, every
    parameter decayed, the old head frozen, CE over the task's logits."""
    import copy

    method, rt = started()
    tasks = rt.benchmark.tasks
    method.before_task(tasks[0])
    finish_untrained(method, tasks[0])
    task = tasks[1]
    method.before_task(task)
    phase = method.phases(task, 2)[0]
    method.before_phase(task, phase)
    convnet = copy.deepcopy(method.backbone)
    fc = ref.ContinualLinear([copy.deepcopy(h) for h in method.heads])
    fc.heads[0].requires_grad_(False)  # update(freeze_old=True)
    official = ref.stage1_optimizer(convnet, fc, 0.01, 0.01, 5e-4)
    optimizer = build_optimizer(method, task, phase, rt.cfg.trainer)
    assert sorted(g["lr"] for g in optimizer.param_groups) == pytest.approx([1e-4, 1e-2])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    rt.train_tf = rt.test_tf  # the same pixels for both
    method.train()
    convnet.train()
    for b in range(2):
        x_raw, y = rt.benchmark.train[1].batch(None, b, 16)
        train_step(method, task, rt, x_raw, y, optimizer=optimizer, params=params)
        feats = convnet.forward_head(convnet.forward_features(rt.test_tf(x_raw)), pre_logits=True)
        loss = ref.stage1_loss(fc(feats), y, task.offset)
        official.zero_grad()
        loss.backward()
        official.step()
    for (name, mine), theirs in zip(method.backbone.named_parameters(), convnet.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7, msg=name)
    for mine, theirs in zip(method.heads, fc.heads, strict=True):
        torch.testing.assert_close(mine.weight, theirs.weight, rtol=1e-5, atol=1e-7)


def run_two_tasks(monkeypatch: pytest.MonkeyPatch, *overrides: str) -> dict[str, object]:
    """Train tasks 0 and 1 through the loop, epochs in the stored order; record each alignment epoch's draw, the heads
    as the alignment starts and as it ends, and the heads as task 2 starts."""
    method, rt = started(*overrides)
    monkeypatch.setattr(Split, "permutation", lambda self: torch.arange(len(self), device=self.y.device))
    seen: dict[str, object] = {"draws": []}
    real_draw, real_phase = SLCA.drawn_split, SLCA.before_phase

    def draw(self, task, phase, epoch):  # type: ignore[no-untyped-def]
        out = real_draw(self, task, phase, epoch)
        seen["draws"].append((epoch, out))  # type: ignore[union-attr]
        return out

    def before_phase(self, task, phase):  # type: ignore[no-untyped-def]
        if phase.name == "align":
            seen["before"] = [{k: v.clone() for k, v in h.state_dict().items()} for h in self.heads]
        real_phase(self, task, phase)

    monkeypatch.setattr(SLCA, "drawn_split", draw)
    monkeypatch.setattr(SLCA, "before_phase", before_phase)
    tasks = rt.benchmark.tasks
    for task in tasks[:2]:
        method.before_task(task)
        run_task(method, task, rt, epochs=rt.cfg.trainer.epochs)
        method.after_task(task)
    seen["after"] = [{k: v.clone() for k, v in h.state_dict().items()} for h in method.heads]
    method.before_task(tasks[2])
    seen["next"] = [{k: v.clone() for k, v in h.state_dict().items()} for h in method.heads[:2]]
    seen["method"] = method
    return seen


def test_the_alignment_phase_is_the_codes_stage_two_and_the_heads_are_recalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's ``features`` phase on the drawn samples against slca.py L174-256 run on the same samples in the same
    order: the aligned heads agree to fp32 rounding; before task 2 every head is its pre-alignment copy, bit for bit."""
    seen = run_two_tasks(monkeypatch)
    draws = dict(seen["draws"])  # type: ignore[arg-type]
    assert sorted(draws) == list(range(5))  # one draw an epoch (epoch 0's made once, when the phase is built)
    heads = []
    for saved in seen["before"]:  # type: ignore[union-attr]
        head = torch.nn.Linear(saved["weight"].shape[1], saved["weight"].shape[0])
        head.load_state_dict(saved)
        heads.append(head)
    fc = ref.ContinualLinear(heads)
    ref.stage2(fc, [(draws[e].x, draws[e].y) for e in range(5)], [2, 2], 1, num_sampled_pcls=8)
    for mine, theirs in zip(seen["after"], fc.heads, strict=True):  # type: ignore[arg-type]
        torch.testing.assert_close(mine["weight"], theirs.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine["bias"], theirs.bias.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(seen["after"][0]["weight"], seen["before"][0]["weight"])  # type: ignore[index]
    for recalled, kept in zip(seen["next"], seen["before"], strict=True):  # type: ignore[arg-type]
        assert all(torch.equal(recalled[k], kept[k]) for k in kept)


def test_without_restore_the_aligned_heads_go_on_to_the_next_task(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = run_two_tasks(monkeypatch, "method.alignment.restore=false")
    for carried, aligned in zip(seen["next"], seen["after"], strict=True):  # type: ignore[arg-type]
        assert all(torch.equal(carried[k], aligned[k]) for k in aligned)


def test_final_norm_reset_is_the_codes_fresh_layernorm() -> None:
    """The pooled micro ViT's fc_norm and a class-token ViT's norm both become nn.LayerNorm(D) as vits.py builds it."""
    for overrides in ((), ("backbone.kwargs.global_pool=token",)):
        method, _ = started("method.final_norm=reset", *overrides)
        backbone = method.backbone
        name = "fc_norm" if isinstance(backbone.fc_norm, torch.nn.LayerNorm) else "norm"
        norm, official = getattr(backbone, name), ref.final_norm(backbone.num_features)
        assert norm.eps == official.eps == 1e-5
        assert all(
            torch.equal(a, b) for a, b in zip(norm.state_dict().values(), official.state_dict().values(), strict=True)
        )


def test_the_phases_storage_and_settings_of_a_task() -> None:
    method, rt = started()
    tasks = rt.benchmark.tasks
    assert [p.name for p in method.phases(tasks[0], 2)] == ["train", "statistics"]
    align = method.phases(tasks[1], 2)[-1]
    assert (align.name, align.epochs, align.data) == ("align", 5, "features")
    assert align.trainer is not None and (align.trainer["optimizer"], align.trainer["batch_size"]) == ("sgd", 8)
    method.before_task(tasks[0])
    bits = method.storage()["bits_per_task"][0]
    d = method.backbone.num_features
    assert bits["class_means"] == 32 * 2 * d and bits["class_covariances"] == 32 * 2 * d * d
    assert bits["head_copy"] == bits["head"] == 32 * (2 * d + 2)


def test_an_slca_run_resumed_mid_alignment_ends_as_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps: task 0 trains 8 (2 epochs of 4), task 1 trains 8 more, then aligns 5 epochs of 4 (4 classes x 8 samples,
    batch 8); step 27 falls in the alignment's third epoch, after its second epoch's checkpoint."""
    overrides = (*SMALL, "trainer.checkpoint_every=1")
    train(tiny_config(*overrides), tmp_path / "whole")
    crash_and_resume(monkeypatch, overrides, tmp_path / "cut", 27)
    whole, cut = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("whole", "cut"))
    assert cut["status"] == "finished" and cut["acc_matrix"] == whole["acc_matrix"]
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / d / "method_artifacts.safetensors") for d in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_slca_run_evaluates_again_from_its_folder(tmp_path: Path) -> None:
    """clbench-eval rebuilds the method (with its reset final norm) and loads the aligned heads and the backbone."""
    overrides = (*TINY, *SMALL, "method.final_norm=reset")
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_config(*overrides), tmp_path / ".hydra" / "config.yaml")
    train(tiny_config(*SMALL, "method.final_norm=reset"), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert reevaluate(tmp_path) == {s: saved["acc_matrix"][s][-1] for s in ("til", "cil")}
    assert np.isfinite(saved["metrics"]["cil"]["final_acc"])
