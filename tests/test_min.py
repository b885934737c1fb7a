"""MIN's rules (PTM spec part 2 §5.7) against an independent transcription of its official code and of its paper's
equations (tests/oracles/min_reference.py): the analytic head equal to the code's recursive least squares, the
random buffer's distribution, the Pi-Noise layer's output, omega by the code's and the paper's rules, the residual
loss, what each task trains, the noise drawn for the whole batch; the phases in the code's order; its state through
checkpoints and artifacts; results.json naming the reading that ran."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clbench.checkpoint import Position
from clbench.errors import ConfigError
from clbench.loop import train
from clbench.loop.resume import replay
from clbench.loop.runtime import build_runtime
from clbench.loop.task import observe_pass, run_task
from clbench.methods.first_session import vit_features
from clbench.methods.parts.pinoise import NoiseLayers, PiNoise, uniform_fan_in
from clbench.methods.parts.ridge import PassStatistics, RidgeStatistics, relu_features
from conftest import tiny_config, trained_task_by_task
from oracles import min_reference as ref

F64 = torch.float64
OFFICIAL = ("method.noise_sampling=false", "method.omega=code", "method.task0_tuning=true")
SMALL = ("method=min", "method.M=40", "method.hidden_dim=8", "trainer.epochs=2")


def solved(batches: list[tuple[torch.Tensor, torch.Tensor]], classes: int, gamma: float) -> torch.Tensor:
    """clbench's head (classes x M) from the batches' summed statistics."""
    stats = RidgeStatistics()
    stats.allocate(batches[0][0].shape[1], classes, torch.device("cpu"))
    one = PassStatistics(batches[0][0].shape[1], classes, torch.device("cpu"))
    for h, y in batches:
        one.observe(h, y)
    one.fold_into(stats)
    return torch.linalg.solve(stats.gram + gamma * torch.eye(len(stats.gram), dtype=F64), stats.cross).T


def test_the_recursive_least_squares_of_the_code_is_the_ridge_of_the_summed_statistics() -> None:
    """Two batches (fp64, M = 8, gamma = 100), the second bringing a class the first lacks (its column appended
    mid-stream, its earlier targets 0): the code's RLS equals (X^T X + gamma I)^-1 X^T Y over both, within 1e-10."""
    gen = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(20, 8, generator=gen, dtype=F64))
    y = torch.cat([torch.randint(0, 2, (9,), generator=gen), torch.randint(0, 3, (11,), generator=gen)])
    y[12] = 2
    rls = ref.RecursiveLeastSquares(8, gamma=100.0)
    for rows in (slice(0, 9), slice(9, 20)):
        rls.fit(x[rows], F.one_hot(y[rows]))
    closed = torch.linalg.solve(x.T @ x + 100 * torch.eye(8, dtype=F64), x.T @ F.one_hot(y, 3).to(F64))
    torch.testing.assert_close(rls.weight, closed, rtol=0, atol=1e-10)
    torch.testing.assert_close(solved([(x[:9], y[:9]), (x[9:], y[9:])], 3, 100.0).T, rls.weight, rtol=0, atol=1e-10)


def test_fitting_the_same_data_k_times_weights_its_data_term_k_times() -> None:
    """The code's four passes of a task (three fit, one refit) on unchanged features: (k X^T X + gamma I)^-1 k X^T Y."""
    gen = torch.Generator().manual_seed(1)
    x = torch.relu(torch.randn(15, 6, generator=gen, dtype=F64))
    y = torch.randint(0, 3, (15,), generator=gen)
    y[0] = 2
    rls = ref.RecursiveLeastSquares(6, gamma=10.0)
    for _ in range(4):
        rls.fit(x, F.one_hot(y))
    onehot = F.one_hot(y, 3).to(F64)
    expected = torch.linalg.solve(4 * x.T @ x + 10 * torch.eye(6, dtype=F64), 4 * x.T @ onehot)
    torch.testing.assert_close(rls.weight, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(solved([(x, y)] * 4, 3, 10.0).T, expected, rtol=0, atol=1e-10)


def test_the_fixed_matrices_follow_the_codes_initialisation_and_their_seed() -> None:
    """W_B (d x M), W_down (d x d2), W_up (d2 x d): U(+-1/sqrt(second dimension)), as nn.Linear.reset_parameters
    draws on those shapes (the oracle draws the code's way: the same bound, the same spread); one seed, one matrix."""
    for rows, cols in ((64, 4096), (768, 192), (192, 768)):
        ours = uniform_fan_in(rows, cols, seed=3)
        code = ref.random_buffer(rows, cols, torch.Generator().manual_seed(3))
        bound = 1 / math.sqrt(cols)
        assert ours.shape == code.shape == (rows, cols)
        assert ours.abs().max() <= bound and code.abs().max() <= bound
        assert abs(float(ours.std()) - float(code.std())) < 0.02 * bound  # both bound / sqrt(3)
        assert abs(float(ours.std()) - bound / math.sqrt(3)) < 0.02 * bound
    assert torch.equal(uniform_fan_in(8, 9, 5), uniform_fan_in(8, 9, 5))
    assert not torch.equal(uniform_fan_in(8, 9, 5), uniform_fan_in(8, 9, 6))
    h = relu_features(torch.randn(5, 64), uniform_fan_in(64, 4096, 3))
    assert h.shape == (5, 4096) and (h >= 0).all()


def generators(layer: PiNoise, count: int, gen: torch.Generator) -> None:
    """``count`` generator pairs with random weights (and the MLP's), as if trained."""
    for _ in range(count):
        layer.expand()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def test_a_pi_noise_layer_computes_the_codes_forward_and_the_papers_mixture() -> None:
    """Three generators, the MLP, random omega: the code's PiNoise.forward (mu + sigma); with a draw xi, the paper's
    r + sum_t omega_t (xi sigma_t + mu_t) W_up plus the MLP (the code's one residual term the paper lacks)."""
    gen = torch.Generator().manual_seed(2)
    layer = PiNoise(12, 5, residual_mlp=True, device=torch.device("cpu"))
    layer.draw(seed=4)
    generators(layer, 3, gen)
    r = torch.randn(2, 7, 12, generator=gen)
    omega = torch.softmax(torch.randn(3, generator=gen), 0)
    banks = {"mu": list(layer.mu), "sigma": list(layer.sigma)}
    code = ref.pinoise_forward(r, layer.down, layer.up, **banks, weight_noise=omega, mlp=layer.mlp)
    torch.testing.assert_close(layer(r, omega), code, rtol=1e-5, atol=1e-5)
    xi = torch.randn(2, 7, 5, generator=gen)
    paper = ref.paper_noise(r, layer.down, layer.up, **banks, omega=omega, eps=xi) + layer.mlp(r)
    torch.testing.assert_close(layer(r, omega, xi), paper, rtol=1e-5, atol=1e-5)


def tiny_vit(depth: int = 2) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=depth, num_heads=2, num_classes=0).eval()


def test_pi_noise_at_initialisation_is_the_identity_and_omega_zero_trains_nothing() -> None:
    """MLP and generators zero: the hooked ViT computes the pretrained one bit for bit. With omega = 0 (the code's
    tasks 0 and 1) the generators' gradients are exactly zero whatever the loss; with omega = 1 they are not."""
    vit = tiny_vit()
    x = torch.randn(3, 3, 16, 16)
    before = vit_features(vit, x)
    noise = NoiseLayers(vit, 4, residual_mlp=True, seed=0)
    noise.expand(torch.zeros(1), trainable=False)
    assert torch.equal(vit_features(vit, x), before)
    for omega, zero in ((0.0, True), (1.0, False)):
        noise.expand(torch.tensor([omega]), trainable=False)
        noise.zero_grad(set_to_none=False)
        with torch.no_grad():
            for p in noise.mlps():
                p.normal_()  # a trained MLP: the generators' inputs are not the pretrained features alone
        vit_features(vit, x).pow(2).sum().backward()
        grads = [p.grad for p in noise.newest()]
        assert all(g is not None for g in grads)
        assert all(bool((g == 0).all()) for g in grads) == zero, omega


def test_omega_by_the_codes_rule_and_by_the_papers() -> None:
    """The code: 0 at tasks 0 and 1, then softmax([cos(p_{t-1}, p_i)]_{i<t} + [1]) (init_weight_noise); the paper:
    softmax_i(cos(p_t, p_i) / tau) over i <= t (Eq. 11-12)."""
    method, rt = build_runtime(tiny_config(*SMALL, *OFFICIAL, "data.num_tasks=3"))
    gen = torch.Generator().manual_seed(3)
    protos = torch.randn(3, method.backbone.num_features, generator=gen)
    method.prototypes.copy_(protos)
    for task in rt.benchmark.tasks:
        expected = ref.init_weight_noise(list(protos[: task.id]), task.id + 1)
        torch.testing.assert_close(method.mixture_weights(task), expected)
    assert torch.equal(method.mixture_weights(rt.benchmark.tasks[1]), torch.zeros(2))
    learned, _ = build_runtime(tiny_config(*SMALL, "method.tau=0.7", "data.num_tasks=3"))
    learned.prototypes.copy_(protos)
    for task in rt.benchmark.tasks:
        expected = ref.paper_omega(list(protos[: task.id + 1]), tau=0.7)
        torch.testing.assert_close(learned.mixture_weights(task), expected)


def run_tasks(*overrides: str) -> tuple:
    """A tiny MIN run, task by task as the loop runs it."""
    cfg = tiny_config(*SMALL, *overrides)
    return trained_task_by_task(cfg)


def test_the_phases_come_in_the_codes_order_and_in_the_papers() -> None:
    """The code's init_train (noise, prototype, fit_fc's 3 augmented passes, re_fit through the test transform) and
    increment_train (fit_fc, noise, prototype, re_fit); the paper's Algorithm 1 for every task (fit, noise, refit; p_t
    from the first fit pass); init_epochs for the first task's noise."""
    official, rt = build_runtime(tiny_config(*SMALL, *OFFICIAL))
    fits = ["fit1", "fit2", "fit3"]
    t0, t1 = rt.benchmark.tasks[:2]
    assert [p.name for p in official.phases(t0, 2)] == ["noise", "prototype", *fits, "refit"]
    assert [p.name for p in official.phases(t1, 2)] == [*fits, "noise", "prototype", "refit"]
    shapes = [(p.observe, p.augment) for p in official.phases(t1, 2)]
    assert shapes == [(True, True)] * 3 + [(False, False), (True, True), (True, False)]
    paper, _ = build_runtime(tiny_config(*SMALL, "method.init_epochs=5"))
    assert [(p.name, p.epochs) for p in paper.phases(t0, 2)] == [*((f, 1) for f in fits), ("noise", 5), ("refit", 1)]
    assert [(p.name, p.epochs) for p in paper.phases(t1, 2)] == [*((f, 1) for f in fits), ("noise", 2), ("refit", 1)]
    assert paper.prototype_phase(t1) == "fit1" and official.prototype_phase(t1) == "prototype"


class Recorder:
    """What the method's observe passes saw: (phase, h, y) per batch, h recomputed from the batch as the method
    computes it (eval mode: no draw)."""

    def __init__(self, method) -> None:
        self.method, self.seen, self.phase = method, [], None
        real_before, real_observe = method.before_phase, method.observe

        def before_phase(task, phase):
            self.phase = phase.name
            real_before(task, phase)

        def observe(x, y, task, rows):
            with torch.no_grad():
                phi = vit_features(method.backbone, x)
            self.seen.append((task.id, self.phase, relu_features(phi, method.projection).double(), y.clone(), phi))
            real_observe(x, y, task, rows)

        method.before_phase, method.observe = before_phase, observe


def test_the_official_path_fits_the_codes_head_and_omega_over_what_each_pass_saw() -> None:
    """The code's path on three tasks: after each task the heads equal MiNbaseNet.fit's recursive least squares over
    the batches every fit and refit pass saw, in order (M = 40, gamma 100); omega at each task is
    init_weight_noise over the prototypes taken after the earlier tasks' training (the mean phi of the prototype
    pass)."""
    cfg = tiny_config(*SMALL, *OFFICIAL)
    method, rt = build_runtime(cfg)
    recorder = Recorder(method)
    rls = ref.RecursiveLeastSquares(40, gamma=100.0)
    prototypes = []
    for task in rt.benchmark.tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=2)
        method.after_task(task)
        mine = [s for s in recorder.seen if s[0] == task.id]
        assert {s[1] for s in mine} == {"prototype", "fit1", "fit2", "fit3", "refit"}
        for _, phase, h, y, _ in mine:
            if phase != "prototype":
                rls.fit(h, F.one_hot(y))
        phi = torch.cat([s[4] for s in mine if s[1] == "prototype"])
        torch.testing.assert_close(method.prototypes[task.id], phi.mean(0), rtol=1e-5, atol=1e-6)
        expected_omega = ref.init_weight_noise(prototypes, task.id + 1)
        torch.testing.assert_close(method.omegas[task.id, : task.id + 1], expected_omega)
        prototypes.append(phi.mean(0))
        seen = task.offset + task.num_classes
        heads = torch.cat([h.weight for h in method.heads])
        torch.testing.assert_close(heads, rls.weight[:, :seen].T.float(), rtol=1e-4, atol=1e-5)
    x = rt.test_tf(rt.benchmark.test[0].x[:6])
    method.eval()
    h = method.features(x, None)
    torch.testing.assert_close(method.predict(x, None), rls.logits(h).float(), rtol=1e-4, atol=1e-5)


def parameters_of(method) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in method.named_parameters()}


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if k in after and not torch.equal(before[k], after[k])}


@pytest.mark.parametrize("reading", ["official", "paper"])
def test_each_task_trains_its_own_generators_and_nothing_earlier(reading: str) -> None:
    """The code's first task: the residual MLPs, every LayerNorm (norm1, norm2, the final norm), generator 0 (zero
    gradient: omega 0) and a head with bias; its later tasks: their generator (task 1's too gets no gradient) and W_aux.
    The paper's: every task its generator, omega and W_aux. Earlier generators, MLPs and the rest of the ViT never move
    afterwards."""
    overrides = OFFICIAL if reading == "official" else ()
    method, rt = build_runtime(tiny_config(*SMALL, *overrides, "trainer.lr=0.05"))
    snapshots = []
    for task in rt.benchmark.tasks:
        method.before_task(task)
        before = parameters_of(method)
        phases = method.phases(task, 2)
        for phase in phases[: [p.name for p in phases].index("noise") + 1]:
            method.before_phase(task, phase)
        names = {id(p): n for n, p in method.named_parameters()}
        trained = {names[id(p)] for p in method.trained}
        run_task(method, task, rt, epochs=2)
        method.after_task(task)
        after = parameters_of(method)
        t = task.id
        generator = {f"noise.layers.0.{bank}.{t}.{k}" for bank in ("mu", "sigma") for k in ("weight", "bias")}
        aux = {"aux.weight", "aux.bias"} if reading == "official" and t == 0 else {"aux.weight"}
        norms = {n for n in before if n.startswith("backbone.") and "norm" in n}
        expected = generator | aux
        if reading == "official" and t == 0:
            expected |= norms | {"noise.layers.0.mlp.weight", "noise.layers.0.mlp.bias"}
        if reading == "paper":
            expected |= {"noise.omega"}
        assert trained == expected, (t, trained ^ expected)
        # the heads are solved, not trained; omega is set anew every task (the rule's values: test_omega_*)
        frozen = moved(before, after) - expected - {n for n in before if n.startswith("heads.")} - {"noise.omega"}
        assert not frozen, (t, frozen)
        snapshots.append(after)
    if reading == "official":  # omega 0 at tasks 0 and 1: their generators stay 0 (weight decay of 0 is 0)
        assert all(not after[f"noise.layers.0.mu.{t}.weight"].any() for t in (0, 1) for after in snapshots[t:])
        assert snapshots[2]["noise.layers.0.mu.2.weight"].any()
    else:
        assert all(s[f"noise.layers.0.mu.{s_t}.weight"].any() for s_t, s in enumerate(snapshots))
    last = snapshots[-1]
    for t, snap in enumerate(snapshots):
        for key in (f"noise.layers.0.sigma.{t}.weight", "noise.layers.0.mlp.weight"):
            if key in snap:
                assert torch.equal(snap[key], last[key]), key


def first_noise_loss(method, rt, task) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training loss on the task's first 8 images once its noise phase has begun, their features as ``features``
    computes them, and their labels."""
    x, y = rt.benchmark.train[task.id].batch(None, 0, 8)
    x = rt.test_tf(x)
    method.train()
    loss, _ = method.training_loss(x, y, task)
    with torch.no_grad():
        h = method.features(x, None)
    return loss, h, y


def test_the_residual_loss_starts_at_the_analytic_heads_cross_entropy() -> None:
    """At the start of task 1's noise phase W_aux = 0: the loss is CE(h W, y) over the seen classes, the transcription's
    run() loss; a step moves W_aux and the generator, never the analytic head."""
    method, rt = build_runtime(tiny_config(*SMALL, *OFFICIAL, "data.num_tasks=2"))
    t0, t1 = rt.benchmark.tasks
    method.before_task(t0)
    run_task(method, t0, rt, epochs=2)
    method.after_task(t0)
    method.before_task(t1)
    for phase in method.phases(t1, 2):  # fit1..3 observed, then the noise phase starts
        method.before_phase(t1, phase)
        if phase.name == "noise":
            break
        observe_pass(method, t1, rt.benchmark.train[1], rt, augment=phase.augment)
    assert method.aux is not None and not method.aux.weight.any()
    loss, h, y = first_noise_loss(method, rt, t1)
    with torch.no_grad():
        analytic = method.seen_logits(h)
    torch.testing.assert_close(loss, F.cross_entropy(analytic, y))
    torch.testing.assert_close(loss, ref.residual_loss(analytic, method.aux, h, y))
    assert analytic.shape[1] == t1.offset + t1.num_classes and analytic.abs().sum() > 0


def test_the_codes_first_task_trains_on_its_auxiliary_head_alone() -> None:
    """The code's task 0 runs its noise phase before any fit (MiN.py L278-281: CE(normal_fc(h), y)): the analytic head,
    solved by nothing yet, adds nothing to the logits."""
    method, rt = build_runtime(tiny_config(*SMALL, *OFFICIAL, "data.num_tasks=1"))
    (t0,) = rt.benchmark.tasks
    method.before_task(t0)
    noise = method.phases(t0, 2)[0]
    assert noise.name == "noise"
    method.before_phase(t0, noise)
    loss, h, y = first_noise_loss(method, rt, t0)
    torch.testing.assert_close(loss, F.cross_entropy(method.aux(h), y))


def test_the_noise_is_drawn_for_the_whole_batch_and_never_in_evaluation() -> None:
    """Sampling: this rank's rows of the whole batch's draws (a second rank's share gives the single process's rows);
    evaluation and the observe passes draw nothing: one image's logits are the same alone and in a batch."""
    method, rt = run_tasks("data.num_tasks=2")
    x = rt.test_tf(rt.benchmark.train[1].x[:6])
    with torch.no_grad():
        for p in method.noise.parameters():
            p.normal_(generator=torch.Generator().manual_seed(1))  # generators that make noise
    method.train()
    feats = {}
    for name, share, rows in (("whole", None, slice(None)), ("rank1", (6, slice(3, 6)), slice(3, 6))):
        torch.manual_seed(7)
        method.batch_share = share
        method.noise.share = method.batch_share or (6, slice(None))
        with torch.no_grad():
            feats[name] = method.features(x[rows], None)
        method.noise.share = None
    torch.testing.assert_close(feats["rank1"], feats["whole"][3:], rtol=1e-5, atol=1e-6)
    torch.manual_seed(8)
    method.noise.share = (6, slice(None))
    with torch.no_grad():
        assert not torch.allclose(method.features(x, None), feats["whole"])  # another draw, other features
    method.noise.share = None
    method.eval()
    together = method.predict(x, None)
    alone = torch.cat([method.predict(x[i : i + 1], None) for i in range(6)])
    torch.testing.assert_close(alone, together, rtol=1e-5, atol=1e-5)
    assert torch.equal(method.predict(x, None), together)


def test_learned_omega_moves_and_is_recorded_with_the_reading_that_ran(tmp_path: Path) -> None:
    """The paper's omega trains (it leaves its softmax initialisation); results.json names the reading (``paper``,
    marked reconstructed) and omega after each task; the code's reading is ``official`` and not reconstructed."""
    import json

    train(tiny_config(*SMALL, "trainer.lr=0.5", "data.num_tasks=2"), tmp_path / "paper")
    paper = json.loads((tmp_path / "paper" / "results.json").read_text())
    assert paper["min"]["variant"] == "paper" and paper["reconstructed"] is True
    assert paper["min"]["omega_per_task"][0] != [1.0]
    train(tiny_config(*SMALL, *OFFICIAL, "data.num_tasks=2"), tmp_path / "code")
    code = json.loads((tmp_path / "code" / "results.json").read_text())
    assert code["min"]["variant"] == "official" and code["reconstructed"] is False
    assert code["min"]["omega_per_task"] == [[0.0], [0.0, 0.0]]
    assert tiny_config(*SMALL, "method.omega=code").method.variant == "mixed"


def test_a_checkpoint_replay_restores_the_state_and_the_seed_redraws_the_fixed_matrices() -> None:
    method, rt = run_tasks(*OFFICIAL)
    state = method.state_dict()
    assert {"stats.gram", "stats.cross", "projection_seed", "prototypes", "omegas", "noise.omega"} <= state.keys()
    assert not any(k.endswith((".down", ".up")) or k == "projection" for k in state)  # drawn from the seed
    fresh, _ = build_runtime(tiny_config(*SMALL, *OFFICIAL, "seed=5"))
    assert not torch.equal(fresh.projection, method.projection)
    replay(fresh, rt.benchmark.tasks, Position(task=len(rt.benchmark.tasks), step=0), epochs=2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.projection, method.projection)
    assert torch.equal(fresh.noise.layers[0].down, method.noise.layers[0].down)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key
    x = rt.test_tf(rt.benchmark.test[2].x[:4])
    assert torch.equal(fresh.eval().predict(x, None), method.predict(x, None))


def test_the_artifacts_hold_what_evaluation_needs_and_not_the_statistics(tmp_path: Path) -> None:
    """The heads, every generator, omega, the seed, and (the code's first task) the MLPs and tuned norms; not G or Q.
    (test_run.py evaluates a finished run again from them, for every method.)"""
    from safetensors.torch import load_file

    train(tiny_config(*SMALL, *OFFICIAL, "data.num_tasks=2"), tmp_path)
    saved = load_file(tmp_path / "method_artifacts.safetensors")
    assert not any("gram" in k or "cross" in k for k in saved)
    assert {k.split(".")[0] for k in saved} == {"head", "noise", "norms", "projection_seed", "omegas", "prototypes"}
    assert "noise.layers.0.mu.1.weight" in saved and "norms.blocks.0.norm1.weight" in saved
    method, _ = build_runtime(tiny_config(*SMALL, *OFFICIAL, "data.num_tasks=2"))
    method.load_artifacts(saved)
    assert method.num_seen == 2 and method.noise.tasks == 2
    torch.testing.assert_close(method.noise.omega, saved["noise.omega"])


def test_storage_states_generators_and_prototypes_per_task() -> None:
    method, rt = run_tasks(*OFFICIAL)
    storage = method.storage()
    d, m, d2 = method.backbone.num_features, 40, 8
    for task, entry in zip(rt.benchmark.tasks, storage["bits_per_task"], strict=True):
        assert entry == {"head": 32 * m * task.num_classes, "Q_columns": 64 * m * task.num_classes,
                         "generators": 32 * 2 * (d2 * d2 + d2), "prototype": 32 * d}  # fmt: skip
    assert storage["shared_bits"]["G"] == 64 * m * m and storage["shared_bits"]["residual_mlps"] == 32 * (d * d + d)
    assert storage["trainable_params"] == 3 * 2 * (d2 * d2 + d2) + (d * d + d) + 2 * 2 * d + 2 * d


@pytest.mark.parametrize(
    ("override", "key"),
    [("method.M=0", "method.M"), ("method.hidden_dim=0", "method.hidden_dim"), ("method.gamma=0", "method.gamma"),
     ("method.omega=fixed", "method.omega"), ("method.fit_passes=-1", "method.fit_passes"),
     ("method.tau=0", "method.tau"), ("method.init_epochs=-2", "method.init_epochs")],
)  # fmt: skip
def test_bad_values_are_refused_before_any_work(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        tiny_config("method=min", override)
