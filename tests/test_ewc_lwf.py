"""EWC and LwF against independent transcriptions of their rules (tests/oracles/{ewc,lwf}_reference.py; BASELINES.md
§4.7, §5.4), plus a small end-to-end run and a resume of each."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from clbench.errors import ConfigError
from clbench.loop import train
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.base import Phase
from clbench.methods.ewc import EWC, per_example_fisher
from clbench.methods.lwf import LwF, distillation
from conftest import crash_and_resume, tiny_config
from oracles import ewc_reference as ewc_ref
from oracles import lwf_reference as lwf_ref
from oracles import rehearsal_reference as rehearsal_ref

FISHER = Phase("fisher", 1, observe=True)


# ----------------------------------------------------------------------------------------------------- EWC: Fisher
@pytest.mark.parametrize("estimator", ["true_label", "expected", "mammoth"])
def test_fisher_of_a_linear_softmax_model_matches_the_closed_form(estimator: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 4)
    x, y = torch.randn(6, 5), torch.tensor([0, 3, 1, 1, 2, 0])
    params = dict(model.named_parameters())
    got = per_example_fisher(model, params, x, y, estimator=estimator, chunk=4)  # two chunks, the second partial
    FW, Fb = torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for i in range(len(x)):
        w, b = ewc_ref.linear_fisher(model.weight.detach(), model.bias.detach(), x[i], int(y[i]), estimator)
        FW, Fb = FW + w, Fb + b
    torch.testing.assert_close(got["weight"].double(), FW, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["bias"].double(), Fb, rtol=1e-5, atol=1e-7)


def test_sampled_fisher_is_one_draw_per_example_and_unbiased() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    x0 = torch.randn(3)
    params = dict(model.named_parameters())
    W, b = model.weight.detach(), model.bias.detach()
    # one example: the estimate is the closed form of one of the labels
    one = per_example_fisher(model, params, x0[None], torch.tensor([0]), estimator="sample")
    candidates = [ewc_ref.linear_fisher(W, b, x0, 0, "sample", sampled=c)[0] for c in range(3)]
    assert any(torch.allclose(one["weight"].double(), c, rtol=1e-5, atol=1e-8) for c in candidates)
    # many copies: the mean approaches the expected (true) Fisher
    n = 4000
    many = per_example_fisher(
        model, params, x0.expand(n, 3), torch.zeros(n, dtype=torch.long), estimator="sample", chunk=1000
    )
    expected, _ = ewc_ref.linear_fisher(W, b, x0, 0, "expected")
    torch.testing.assert_close(many["weight"].double() / n, expected, rtol=0.1, atol=1e-3)


# ----------------------------------------------------------------------------------------------------- EWC: penalty
def consolidate(method: EWC, task, fishers: dict[str, torch.Tensor], count: int = 5) -> None:
    """Finish ``task`` with the given per-parameter Fishers (as an observe pass over ``count`` images would leave
    them) at the method's current parameters."""
    method.before_phase(task, FISHER)
    for name, total in method.sums.items():
        total.copy_(fishers[name] * count)
    method.count.fill_(count)
    method.after_task(task)


def named(method: EWC) -> dict[str, nn.Parameter]:
    return dict(method.named_parameters())


def run_tasks_with_random_fishers(method: EWC, tasks, gen: torch.Generator):
    """Consolidate each task at random parameters with random Fishers (some entries 0); returns [(F_k, θ*_k)]."""
    stored = []
    for task in tasks:
        method.before_task(task)
        params = named(method)
        with torch.no_grad():
            for p in params.values():
                p.copy_(torch.randn(p.shape, generator=gen))
        fishers = {}
        method.before_phase(task, FISHER)  # the parameters it observes: the anchored ones and the task's head
        for name in method.sums:
            f = torch.rand(params[name].shape, generator=gen)
            fishers[name] = f * (torch.rand(f.shape, generator=gen) > 0.2)
        consolidate(method, task, fishers)
        stored.append((fishers, {n: p.detach().clone() for n, p in params.items()}))
    return stored


@pytest.mark.parametrize("half", [True, False])
def test_collapsed_offline_penalty_equals_the_explicit_sum_over_tasks(half: bool) -> None:
    method, rt = build_runtime(tiny_config("method=ewc", "method.lam=3.0", f"method.half={half}"))
    t0, t1, t2 = rt.benchmark.tasks
    gen = torch.Generator().manual_seed(1)
    stored = run_tasks_with_random_fishers(method, [t0, t1], gen)
    method.before_task(t2)
    params = named(method)
    with torch.no_grad():
        for p in params.values():
            p.copy_(torch.randn(p.shape, generator=gen))
    covered = [n for n in stored[-1][0] if not n.startswith(f"heads.{t2.id}.")]
    theta = [params[n].detach().double() for n in covered]
    per_task = [
        (
            [f.get(n, torch.zeros_like(params[n])).double() for n in covered],
            [a.get(n, torch.zeros_like(params[n])).double() for n in covered],
        )
        for f, a in stored
    ]
    expected = ewc_ref.offline_penalty(theta, per_task, 3.0, half)
    got = method.penalty(t2.id).item()
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(("half", "gamma"), [(True, 0.5), (False, 1.0)])
def test_online_merge_and_penalty_follow_the_conventions(half: bool, gamma: float) -> None:
    method, rt = build_runtime(
        tiny_config(
            "method=ewc", "method.online=true", f"method.gamma={gamma}", "method.lam=2.0", f"method.half={half}"
        )
    )
    t0, t1, t2 = rt.benchmark.tasks
    gen = torch.Generator().manual_seed(2)
    stored = run_tasks_with_random_fishers(method, [t0, t1], gen)
    method.before_task(t2)
    params = named(method)
    names = list(stored[-1][0])
    merged = {
        n: ewc_ref.online_merge([f.get(n, torch.zeros_like(params[n])).double() for f, _ in stored], gamma)
        for n in names
    }
    for n in names:  # the running Fisher the method keeps: F̃_2 = γ F_1 + F_2
        torch.testing.assert_close(method.importance.get_buffer(n.replace(".", "__")).double(), merged[n])
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=gen))
    theta = [params[n].detach().double() for n in names]
    anchor = [stored[-1][1][n].double() for n in names]
    expected = ewc_ref.online_penalty(theta, [merged[n] for n in names], anchor, lam=2.0, gamma=gamma, half=half)
    assert method.penalty(t2.id).item() == pytest.approx(expected, rel=1e-6)
    if not half and gamma == 1.0:  # mammoth's convention: λ Σ F̃ (θ − θ*)², no ½ and no γ on reading
        mammoth = ewc_ref.online_penalty(
            theta, [merged[n] for n in names], anchor, lam=2.0, gamma=gamma, half=False, gamma_on_read=False
        )
        assert method.penalty(t2.id).item() == pytest.approx(mammoth, rel=1e-6)


@pytest.mark.parametrize("online", [False, True])
def test_penalty_and_its_gradient_vanish_at_the_anchor_and_skip_the_current_head(online: bool) -> None:
    method, rt = build_runtime(tiny_config("method=ewc", f"method.online={online}", "method.lam=10.0"))
    t0, t1, _ = rt.benchmark.tasks
    gen = torch.Generator().manual_seed(3)
    run_tasks_with_random_fishers(method, [t0], gen)
    method.before_task(t1)
    penalty = method.penalty(t1.id)
    assert penalty.item() == 0.0
    penalty.backward()
    for name, p in method.named_parameters():
        if name.startswith("heads.1."):
            assert p.grad is None  # the current head has no anchor
        else:
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
    method.zero_grad(set_to_none=True)
    with torch.no_grad():  # moving the current head changes nothing; moving an anchored weight does
        method.heads[1].weight.add_(1.0)
        assert method.penalty(t1.id).item() == 0.0
        method.heads[0].weight.add_(1.0)
        assert method.penalty(t1.id).item() > 0.0


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_heavy_ball_sgd_on_a_quadratic_is_stable_exactly_below_two_times_one_plus_momentum(momentum: float) -> None:
    """The bound the EWC check uses, from first principles: torch's SGD with momentum μ on ½ h θ² converges for
    η h just below 2 (1 + μ) and grows without bound just above (the recursion's roots cross the unit circle)."""
    from clbench.methods.ewc import sgd_bound

    def after(steps: int, eta_h: float) -> float:
        theta = torch.ones(1, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([theta], lr=eta_h, momentum=momentum)  # h = 1: η h = lr
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * theta.square()).sum().backward()
            opt.step()
        return abs(float(theta.detach()))

    bound = sgd_bound(momentum)
    assert bound == 2 * (1 + momentum)
    assert after(3000, 0.98 * bound) < 1e-3 and after(3000, 1.02 * bound) > 1e3


def ewc_after_one_task(lam: float, fisher: float, *overrides: str) -> tuple[EWC, object]:
    """An EWC run at task 1 whose task 0 left the Fisher ``fisher`` on every anchored parameter."""
    method, rt = build_runtime(tiny_config("method=ewc", f"method.lam={lam}", *overrides))
    t0, t1 = rt.benchmark.tasks[:2]
    method.before_task(t0)
    method.before_phase(t0, FISHER)
    consolidate(method, t0, {n: torch.full_like(s, fisher) for n, s in method.sums.items()})
    method.before_task(t1)
    return method, rt


@pytest.mark.parametrize(("half", "momentum"), [(True, 0.9), (False, 0.0)])
def test_a_task_whose_penalty_breaks_sgds_stability_bound_is_refused_before_it_trains(
    half: bool, momentum: float
) -> None:
    """The penalty's curvature 2·s·λ·F (s = ½ with half) times the learning rate against 2 (1 + μ): refused at the
    bound (naming method.lam, trainer.lr and the bound), trained just below it; AdamW is not bound."""
    from clbench.loop.optim import build_optimizer

    lr, fisher = 0.01, 0.5
    sgd = ("trainer.optimizer=sgd", f"trainer.momentum={momentum}", f"trainer.lr={lr}", "trainer.weight_decay=0")
    curvature_per_lam = 2 * (0.5 if half else 1.0) * fisher
    limit = 2 * (1 + momentum) / (lr * curvature_per_lam)  # the largest λ SGD takes
    train_phase = Phase("train", 1)
    for lam, refused in ((1.001 * limit, True), (0.999 * limit, False)):
        method, rt = ewc_after_one_task(lam, fisher, f"method.half={half}", *sgd)
        task = rt.benchmark.tasks[1]
        optimizer = build_optimizer(method, task, train_phase, rt.cfg.trainer)
        if refused:
            with pytest.raises(ConfigError, match=r"method\.lam=.*trainer\.lr.*stability bound 2 \(1 \+ trainer"):
                method.check_steps(task, train_phase, optimizer)
        else:
            method.check_steps(task, train_phase, optimizer)
    method, rt = ewc_after_one_task(100 * limit, fisher, f"method.half={half}", "trainer.optimizer=adamw")
    task = rt.benchmark.tasks[1]
    method.check_steps(task, train_phase, build_optimizer(method, task, train_phase, rt.cfg.trainer))


def test_a_lambda_no_fp32_run_can_hold_is_refused_before_any_work() -> None:
    """λ = 1e300: its penalty weight is infinite in fp32 (any optimizer); under SGD a λ·lr so large that the bound
    would need every Fisher value below fp32's smallest normal number."""
    with pytest.raises(ConfigError, match=r"method\.lam.*fp32"):
        tiny_config("method=ewc", "method.lam=1e300")
    with pytest.raises(ConfigError, match=r"method\.lam.*trainer\.lr.*fp32"):
        tiny_config("method=ewc", "method.lam=1e38", "trainer.optimizer=sgd", "trainer.lr=10")
    tiny_config("method=ewc", "method.lam=1e37")  # AdamW: a large but representable weight trains


def test_mammoths_fisher_divisor_is_the_batches_times_the_batch_size() -> None:
    """ewc_on.py L60: fish /= len(train_loader) x batch_size = ⌈N/B⌉·B (N = 60 images, B = 16: 64), not N."""
    from clbench.loop.task import observe_pass

    fishers = {}
    for divisor in ("examples", "mammoth"):
        method, rt = build_runtime(
            tiny_config("method=ewc", "method.fisher=true_label", f"method.fisher_divisor={divisor}")
        )
        t0 = rt.benchmark.tasks[0]
        method.before_task(t0)
        method.before_phase(t0, FISHER)
        observe_pass(method, t0, rt.benchmark.train[0], rt)
        method.after_task(t0)
        fishers[divisor] = torch.cat([b.flatten() for b in method.importance.buffers()])
    n, batch = len(rt.benchmark.train[0]), rt.cfg.trainer.batch_size
    padded = -(-n // batch) * batch
    assert (n, padded) == (60, 64)
    torch.testing.assert_close(fishers["mammoth"], fishers["examples"] * n / padded, rtol=1e-6, atol=0)


def test_ewc_config_is_validated() -> None:
    for bad in ("method.lam=-1", "method.lam=nan", "method.gamma=0", "method.gamma=1.5", "method.fisher=batched",
                "method.fisher_divisor=batches"):  # fmt: skip
        with pytest.raises(ConfigError, match=r"method\."):
            tiny_config("method=ewc", bad)


# ----------------------------------------------------------------------------------------------------- LwF
def test_kd_matches_the_smoothed_softmax_form_and_its_gradient() -> None:
    torch.manual_seed(0)
    z, z_old, T = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64), 2.0
    p = lwf_ref.softmax(z_old[0].tolist())  # mammoth's smooth identity: softmax(z)^{1/T}/Σ = softmax(z/T)
    assert lwf_ref.smooth(p, T) == pytest.approx(torch.softmax(z_old[0] / T, 0).tolist(), rel=1e-12)
    z.requires_grad_(True)
    kd = distillation(z, z_old, T)
    expected = sum(lwf_ref.kd_row(z[i].tolist(), z_old[i].tolist(), T) for i in range(4)) / 4
    assert kd.item() == pytest.approx(expected, rel=1e-5)
    kd.backward()
    grad = torch.tensor([lwf_ref.kd_grad_row(z[i].tolist(), z_old[i].tolist(), T) for i in range(4)]) / 4
    torch.testing.assert_close(z.grad, grad.to(z.grad.dtype), rtol=1e-5, atol=1e-7)


def trained_first_task(*overrides: str) -> tuple[LwF, object]:
    method, rt = build_runtime(tiny_config("method=lwf", *overrides))
    t0 = rt.benchmark.tasks[0]
    method.before_task(t0)
    run_task(method, t0, rt, epochs=1)
    method.after_task(t0)
    return method, rt


@pytest.mark.parametrize("scope", ["til", "cil"])
def test_kd_before_the_first_update_is_the_teacher_entropy_with_zero_gradient(scope: str) -> None:
    method, rt = trained_first_task(f"method.scope={scope}", "data.num_tasks=3", "method.teacher=online")
    t1 = rt.benchmark.tasks[1]
    method.before_task(t1)
    method.before_phase(t1, Phase("train", 1))
    groups = method.param_groups(t1, Phase("train", 1))
    assert any(p is method.heads[0].weight for p in groups[0]["params"])  # old heads train through the distillation
    torch.manual_seed(1)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(t1.offset, t1.offset + t1.num_classes, (8,))
    teacher = [z.tolist() for z in method.teacher.logits(x)]
    student = [method.heads[k](method.features(x, t1.id)).tolist() for k in range(t1.id)]
    torch.testing.assert_close(torch.tensor(teacher), torch.tensor(student), rtol=0, atol=0)
    loss, logs = method.training_loss(x, y, t1)
    flat = [[v for h in t for v in h] for t in zip(*teacher, strict=True)] if scope == "cil" else None
    rows = [[h[i] for h in teacher] for i in range(8)]
    ent = (
        [lwf_ref.entropy(lwf_ref.softmax([v / 2.0 for v in r])) for r in flat]
        if flat
        else [sum(lwf_ref.entropy(lwf_ref.softmax([v / 2.0 for v in h])) for h in r) for r in rows]
    )
    assert logs["kd"].item() == pytest.approx(sum(ent) / 8, rel=1e-5)
    assert logs["kd"].item() == pytest.approx(lwf_ref.lwf_kd(student, teacher, 2.0, scope), rel=1e-5)
    loss.backward()
    with_kd = {n: p.grad.clone() for n, p in method.named_parameters() if p.grad is not None}
    method.zero_grad(set_to_none=True)
    method.config.lam = 0.0
    method.training_loss(x, y, t1)[0].backward()
    for n, p in method.named_parameters():
        if n in with_kd:
            torch.testing.assert_close(with_kd[n], p.grad, rtol=1e-4, atol=1e-6)


def test_warmup_leaves_the_backbone_and_old_heads_bit_identical_and_the_teacher_out_of_the_optimizer() -> None:
    method, rt = trained_first_task("trainer.weight_decay=0.1", "method.teacher=online")
    t1 = rt.benchmark.tasks[1]
    method.before_task(t1)
    assert not any(n.startswith("teacher.") for n, _ in method.named_parameters())
    assert any(k.startswith("teacher.backbone.") for k in method.state_dict())
    assert not any(k.startswith("teacher") for k in method.artifacts())
    trainable = sum(p.numel() for n, p in method.named_parameters() if not n.startswith("teacher."))
    assert method.storage()["trainable_params"] == trainable
    before = {k: v.clone() for k, v in method.state_dict().items() if not k.startswith("heads.1.")}
    new_head = method.heads[1].weight.detach().clone()
    run_task(method, t1, rt, epochs=0)  # the warm-up phase only (warmup_epochs=1, train 0 epochs)
    after = method.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert not torch.equal(method.heads[1].weight, new_head)


def test_a_recorded_teacher_reads_back_the_teachers_logits_by_position() -> None:
    """teacher=recorded: the record phase (test transform, eval mode) stores the teacher's logits at each image's
    position in the task's data; a batch's ids read back what the frozen copy gives those images."""
    from clbench.loop.task import observe_pass

    method, rt = trained_first_task("data.num_tasks=3")
    t1 = rt.benchmark.tasks[1]
    method.before_task(t1)
    phases = method.phases(t1, 1)
    assert [p.name for p in phases] == ["record", "warmup", "train"] and method.takes_ids()
    frozen = copy.deepcopy(method.teacher)
    method.before_phase(t1, phases[0])
    observe_pass(method, t1, rt.benchmark.train[1], rt)
    method.before_phase(t1, phases[1])
    assert method.teacher is None  # not needed once recorded
    ids = torch.tensor([5, 0, 3])
    x = rt.test_tf(rt.benchmark.train[1].x[ids])
    torch.testing.assert_close(method.teacher_targets(x, t1, ids), torch.cat(frozen.logits(x), 1), rtol=1e-5, atol=1e-6)


def test_mammoths_lwf_setting_warms_up_on_the_new_block_and_adds_wd_reg() -> None:
    """mammoth@cb9a36d models/lwf.py: the warm-up's CE over the new classes' logits only
    (``classifier(feats)[:, mask]``, labels shifted), whatever the later CE; the training loss CE over the seen
    classes + alpha * KD over the old classes (one softmax, T = 2) + wd_reg * the sum of every squared parameter."""
    alpha, wd_reg = 3.0, 5e-4
    overrides = ("method.loss_scope=seen", "method.scope=cil", f"method.lam={alpha}", f"method.wd_reg={wd_reg}")
    method, rt = trained_first_task(*overrides, "data.num_tasks=3", "method.teacher=online")
    t1 = rt.benchmark.tasks[1]
    method.before_task(t1)
    torch.manual_seed(2)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(t1.offset, t1.offset + t1.num_classes, (6,))
    method.before_phase(t1, Phase("warmup", 1))
    with torch.no_grad():
        warm, _ = method.training_loss(x, y, t1)
        new_block = method.seen_logits(method.features(x, 1))[:, t1.offset :]
    assert warm.item() == pytest.approx(
        rehearsal_ref.mean(rehearsal_ref.cross_entropy_rows(new_block.tolist(), (y - t1.offset).tolist())), rel=1e-5
    )
    method.before_phase(t1, Phase("train", 1))
    with torch.no_grad():  # the student moves away from its teacher: the distillation is not trivial
        for p in method.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
        loss, _ = method.training_loss(x, y, t1)
        seen_logits = method.seen_logits(method.features(x, 1))
        old = torch.cat(method.teacher.logits(x), 1)
    ce = rehearsal_ref.mean(rehearsal_ref.cross_entropy_rows(seen_logits.tolist(), y.tolist()))
    kd = lwf_ref.lwf_kd([seen_logits[:, : t1.offset].tolist()], [old.tolist()], 2.0, "cil")
    squares = sum(
        float(p.detach().double().square().sum()) for p in (*method.backbone.parameters(), *method.heads.parameters())
    )
    assert loss.item() == pytest.approx(ce + alpha * kd + wd_reg * squares, rel=1e-5)


def test_a_recorded_teacher_under_mixing_is_refused() -> None:
    """The student would see a mix of two images while its targets are the clean image's: online only."""
    with pytest.raises(ConfigError, match=r"method\.teacher.*online with trainer\.mixup"):
        tiny_config("method=lwf", "method.teacher=recorded", "trainer.mixup=0.8")
    tiny_config("method=lwf", "method.teacher=online", "trainer.cutmix=1.0")


def test_lwf_config_is_validated() -> None:
    for bad in ("method.lam=-1", "method.T=0", "method.T=inf", "method.scope=both", "method.warmup_epochs=-1",
                "method.wd_reg=-1"):  # fmt: skip
        with pytest.raises(ConfigError, match=r"method\."):
            tiny_config("method=lwf", bad)


@pytest.mark.parametrize("method", ["lwf", "bic"])
def test_a_temperature_fp32_cannot_compute_with_is_refused_naming_the_limit(method: str) -> None:
    """The distillation divides fp32 logits by T: T must be an fp32 number, i.e. at least the smallest normal fp32,
    2**-126 (below, fp32 holds it as a subnormal or 0, and the gradient's 1/T exceeds fp32's largest, 3.4e38, once T <
    1 / 3.4e38). Before, T=1e-300 passed and trained to NaN."""
    tiny = 2.0**-126
    assert (
        float(torch.tensor(1e-300, dtype=torch.float32)) == 0.0
        and float(torch.tensor(tiny, dtype=torch.float32)) == tiny
    )
    with pytest.raises(ConfigError, match=r"`method\.T`: 1e-300\. Allowed: a finite float >= 1\.175e-38 \(2\*\*-126"):
        tiny_config(f"method={method}", "method.T=1e-300")
    assert tiny == tiny_config(f"method={method}", f"method.T={tiny!r}").method.T


# ----------------------------------------------------------------------------------------------------- end to end
def til(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.mark.parametrize(("method", "crash_step"), [("ewc", 14), ("lwf", 23)])
def test_a_run_resumed_mid_task_gives_the_uninterrupted_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, crash_step: int
) -> None:
    """Crash in task 1 (EWC: the penalty is active; LwF: the teacher exists) and resume from the checkpoint."""
    overrides = (f"method={method}", "data.num_tasks=2", "trainer.eval_random_init=false", "trainer.checkpoint_every=1")
    train(tiny_config(*overrides), tmp_path / "whole")
    whole = til(tmp_path / "whole")
    assert (
        whole["status"] == "finished"
        and len(whole["acc_matrix"]["til"]) == 2
        and whole["metrics"]["til"]["final_acc"] > 50
    )  # chance: 50
    crash_and_resume(monkeypatch, overrides, tmp_path / "cut", crash_step)
    cut = til(tmp_path / "cut")
    assert cut["acc_matrix"] == whole["acc_matrix"]
    assert cut["metrics"] == whole["metrics"]
