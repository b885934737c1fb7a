"""EASE's rules (PTM spec part 1 §3.7) against an independent transcription of its official code
(tests/oracles/ease_reference.py, the code's loops; tests/oracles/petl_reference.py, its adapter ViT): the
semantic-guided prototype complement (by hand, and as solve_sim_reset / solve_similarity compute it), the reweighted
ensemble logits (forward_reweight), each subspace alone at alpha = beta = 0, APER mode (moni_adam) as APER with the same
adapter, a fresh adapter set as the pretrained ViT; a whole run's prototypes and logits as the code computes them from
the same weights; what each task trains; its state through checkpoints and artifacts."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from clbench.errors import ConfigError
from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import build_runtime
from clbench.loop.step import train_step
from clbench.loop.task import run_task
from clbench.methods.first_session import vit_features
from conftest import assert_replays, one_step_into, optimized, tiny_config
from oracles import ease_reference as ref
from oracles import petl_reference as pref

D = 32  # TINY's ViT width
# Unequal tasks (init_cls 4, increment 2): every class range of the code's get_cls_range is exercised.
UNEQUAL = ("data.init_classes=4", "data.increment=2", "data.tasks=4", "data.num_tasks=3")
INIT_CLS, INC = 4, 2


def build(*overrides: str):
    return build_runtime(tiny_config("method=ease", "method.bottleneck=8", *overrides))


def run_tasks(*overrides: str):
    method, rt = build(*overrides)
    for task in rt.benchmark.tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=rt.cfg.trainer.epochs)
        method.after_task(task)
    return method.eval(), rt


def started(*overrides: str, tasks: int = 3):
    """A method with ``tasks`` tasks begun (heads and adapter sets), nothing trained."""
    method, rt = build(*overrides)
    for task in rt.benchmark.tasks[:tasks]:
        method.before_task(task)
    return method, rt


def code_fc(method, tasks: int) -> torch.Tensor:
    """The method's prototypes of ``tasks`` tasks in the code's layout: fc.weight[c, block * d : (block + 1) * d]."""
    subspaces = len(method.subspaces())
    return torch.cat([method.prototypes(i)[:, :subspaces].flatten(1) for i in range(tasks)])


def set_prototypes(method, fc: torch.Tensor) -> None:
    """Write a code-layout fc into the method's heads."""
    subspaces = fc.shape[1] // D
    with torch.no_grad():
        for task in method.tasks[: method.num_seen]:
            rows = fc[task.offset : task.offset + task.num_classes]
            method.prototypes(task.id)[:, :subspaces] = rows.view(len(rows), subspaces, D)


def test_the_complement_of_two_old_classes_is_the_softmax_of_their_cosines_by_hand() -> None:
    """PTM spec §3.7.1: old classes a1, a2 whose subspace-0 prototypes equal the new classes' r1, r2 exactly (e1, e2,
    orthogonal): cos(a1, .) = (1, 0), softmax = (e / (e + 1), 1 / (e + 1)) = (0.7311, 0.2689), so P[a1, 1] =
    0.7311 P[r1, 1] + 0.2689 P[r2, 1] and P[a2, 1] the mirror; what solve_sim_reset's loops give too."""
    method, _ = started(tasks=2)
    e = torch.eye(D)
    v1, v2 = 2 * e[2], e[3] - e[4]
    fc = torch.zeros(4, 2 * D)
    fc[0, :D], fc[1, :D], fc[2, :D], fc[3, :D] = e[0], e[1], e[0], e[1]
    fc[2, D:], fc[3, D:] = v1, v2
    set_prototypes(method, fc)
    method.complement(1)
    s = math.e / (math.e + 1)
    assert abs(s - 0.7310585786300049) < 1e-15
    got = code_fc(method, 2)
    torch.testing.assert_close(got[0, D:], s * v1 + (1 - s) * v2)
    torch.testing.assert_close(got[1, D:], (1 - s) * v1 + s * v2)
    torch.testing.assert_close(got[2:], fc[2:])  # the new classes' own prototypes untouched
    expected = ref.solve_sim_reset(fc, cur_task=1, init_cls=2, inc=2, total_classes=4, out_dim=D, use_init_ptm=False)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("ptm", "recompute"), [(False, True), (True, True), (False, False), (True, False)], ids=str)
def test_the_vectorised_complement_is_the_codes_loops_task_after_task(ptm: bool, recompute: bool) -> None:
    """Random real prototypes arriving task by task (unequal tasks): after every task the old classes' synthesised
    prototypes are solve_sim_reset's (recalc_sim) or solve_similarity's, and every real one is kept."""
    method, rt = build(*UNEQUAL, f"method.ptm_block={ptm}", f"method.recompute_complement={recompute}")
    gen = torch.Generator().manual_seed(0)
    fc, known = None, 0
    for task in rt.benchmark.tasks:
        method.before_task(task)
        subspaces = len(method.subspaces())
        total = task.offset + task.num_classes
        fc = ref.update_fc(fc, total, subspaces * D, D)
        fc[known:total] = torch.randn(task.num_classes, subspaces * D, generator=gen)  # replace_fc's means
        set_prototypes(method, fc)
        method.complement(task.id)
        if recompute:
            fc = ref.solve_sim_reset(fc, cur_task=task.id, init_cls=INIT_CLS, inc=INC, total_classes=total,
                                     out_dim=D, use_init_ptm=ptm)  # fmt: skip
        else:
            fc = ref.solve_similarity(fc, cur_task=task.id, known_classes=known, init_cls=INIT_CLS, inc=INC,
                                      out_dim=D, use_init_ptm=ptm)  # fmt: skip
        torch.testing.assert_close(code_fc(method, task.id + 1), fc, rtol=1e-5, atol=1e-6)
        known = total


@pytest.mark.parametrize(("ptm", "alpha", "beta"), [(False, 0.1, 0.0), (True, 0.005, 1.0), (True, 0.3, 0.5)])
def test_the_logits_are_forward_reweights_loops(ptm: bool, alpha: float, beta: float) -> None:
    """Random features and prototypes after the third task (t = 2, unequal tasks): the CIL logits are
    forward_reweight's, the TIL logits its columns of the task's classes, in fp32 under bf16 autocast."""
    method, _ = started(*UNEQUAL, f"method.ptm_block={ptm}", f"method.alpha={alpha}", f"method.beta={beta}")
    gen = torch.Generator().manual_seed(1)
    subspaces = len(method.subspaces())
    fc = torch.randn(8, subspaces * D, generator=gen)
    set_prototypes(method, fc)
    feats = torch.randn(5, subspaces * D, generator=gen)
    expected = ref.forward_reweight(feats, fc, cur_task=2, alpha=alpha, beta=beta, init_cls=INIT_CLS, inc=INC,
                                    out_dim=D, use_init_ptm=ptm)  # fmt: skip
    torch.testing.assert_close(method.seen_logits(feats), expected, rtol=1e-5, atol=1e-6)
    for task in method.tasks:
        columns = expected[:, task.offset : task.offset + task.num_classes]
        torch.testing.assert_close(method.head_logits(feats, task.id), columns, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = method.seen_logits(feats)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, expected, rtol=1e-5, atol=1e-6)


def test_with_alpha_and_beta_zero_a_class_is_scored_in_its_own_subspace_only() -> None:
    """PTM spec §3.7.3: z_c = cos(phi_i(x), P[c, i]) for a class c of task i, whatever the other subspaces hold."""
    method, _ = started(*UNEQUAL, "method.ptm_block=true", "method.alpha=0", "method.beta=0")
    gen = torch.Generator().manual_seed(2)
    fc = torch.randn(8, 4 * D, generator=gen)
    set_prototypes(method, fc)
    feats = torch.randn(3, 4 * D, generator=gen)
    logits = method.seen_logits(feats)
    for task in method.tasks:
        own = slice((task.id + 1) * D, (task.id + 2) * D)  # block 0 is the PTM's
        for c in range(task.offset, task.offset + task.num_classes):
            expected = F.cosine_similarity(feats[:, own], fc[c, own][None], dim=1)
            torch.testing.assert_close(logits[:, c], expected, rtol=1e-5, atol=1e-6)


def test_a_fresh_adapter_set_is_the_pretrained_vit_and_not_a_copy_of_the_last() -> None:
    """PTM spec §3.7.5: W_up = 0, so phi_t = phi_PTM bit for bit, with an earlier set trained or not; each set is
    drawn afresh (get_new_adapter), not copied from the one before."""
    method, rt = started(tasks=1)
    x = rt.test_tf(rt.benchmark.test[0].x)
    fresh, _ = build_runtime(tiny_config("method=simplecil"))
    pretrained = vit_features(fresh.backbone.eval(), x)
    method.eval()
    assert torch.equal(method.subspace_features(x, None), pretrained)
    assert torch.equal(method.subspace_features(x, 0), pretrained)
    with torch.no_grad():
        for p in method.sets.parameters(0):
            p.add_(0.3 * torch.randn_like(p))
    method.after_task(method.tasks[0])
    method.before_task(method.tasks[1])
    assert not torch.equal(method.subspace_features(x, 0), pretrained)
    assert torch.equal(method.subspace_features(x, 1), pretrained)
    assert not torch.equal(method.sets.banks[0].sets[1].down.weight, method.sets.banks[0].sets[0].down.weight)


def reference_features(method, weights: dict, x: torch.Tensor, k: int | None) -> torch.Tensor:
    """petl_reference's ViT (timm's pre-norm ViT, no clbench code) through adapter set ``k`` (None: none)."""
    adapters = None
    if k is not None:
        adapters = [{**bank.sets[k].state_dict(), "scale": bank.sets[k].scale} for bank in method.sets.banks]
    return pref.features(x, weights, depth=1, heads=2, patch=4, avg=True, adapters=adapters)


@pytest.mark.parametrize(
    "overrides",
    [(), ("method.ptm_block=true", "method.alpha=0.3", "method.beta=0.5"), ("method.recompute_complement=false",)],
    ids=["default", "ptm_block", "no_recompute"],
)
def test_a_runs_prototypes_and_logits_are_the_codes_from_the_same_weights(overrides: tuple[str, ...]) -> None:
    """Three trained tasks (unequal): with the features the code's ViT computes from the run's pretrained weights and
    adapter sets (forward_proto, block by block), the code's update_fc / replace_fc / complement give the method's
    prototypes, and EaseNet's test forward its CIL logits."""
    method, rt = run_tasks(*UNEQUAL, "trainer.epochs=1", *overrides)
    assert all(bank.sets[k].up.weight.any() for bank in method.sets.banks for k in range(3))  # every set trained
    fresh, _ = build_runtime(tiny_config("method=simplecil", *UNEQUAL))
    weights = {k: v.detach() for k, v in fresh.backbone.state_dict().items()}
    ptm, recompute = method.ptm, method.config.recompute_complement
    indices = [None] * ptm
    features, labels = [], []
    for task in rt.benchmark.tasks:
        split = rt.benchmark.train[task.id]
        x = rt.test_tf(split.x)
        with torch.no_grad():
            features.append({-1 if k is None else k: reference_features(method, weights, x, k)
                             for k in [*indices, *range(task.id + 1)]})  # fmt: skip
        labels.append(split.y)
    history = ref.run_tasks(features, labels, init_cls=INIT_CLS, inc=INC, out_dim=D, use_init_ptm=ptm,
                            recalc_sim=recompute)  # fmt: skip
    torch.testing.assert_close(code_fc(method, 3), history[-1], rtol=1e-4, atol=1e-5)
    x = rt.test_tf(torch.cat([split.x for split in rt.benchmark.test]))
    with torch.no_grad():
        feats = torch.cat([reference_features(method, weights, x, k) for k in [*indices, 0, 1, 2]], dim=1)
    c = method.config
    expected = ref.ease_logits(feats, history[-1], cur_task=2, alpha=c.alpha, beta=c.beta, init_cls=INIT_CLS,
                               inc=INC, out_dim=D, use_init_ptm=ptm)  # fmt: skip
    torch.testing.assert_close(method.predict(x, None), expected, rtol=1e-4, atol=1e-5)


def test_aper_mode_is_aper_with_the_same_adapter_and_the_codes_moni_adam_predictions() -> None:
    """PTM spec §3.7.4: moni_adam trains adapter set 0 only, then the plain cosine over [phi_PTM; phi_0] with no
    complement: APER's logits once APER's adapter is EASE's. The code also runs every test image through a fresh set
    per later task (W_up = 0: phi_PTM again) against zero prototype columns: the same predictions, its logits a
    positive multiple of these per image."""
    ease, rt = run_tasks("method.aper_mode=true", "trainer.epochs=1")
    assert len(ease.sets) == 1 and [len(ease.phases(t, 1)) for t in rt.benchmark.tasks] == [2, 1, 1]
    aper, _ = build_runtime(tiny_config("method=aper", "method.bottleneck=8", "trainer.epochs=0"))
    with torch.no_grad():
        for wrapper, bank in zip(aper.first.petl.wrappers, ease.sets.banks, strict=True):
            wrapper.adapter.load_state_dict(bank.sets[0].state_dict())
    for task in rt.benchmark.tasks:
        aper.before_task(task)
        run_task(aper, task, rt, epochs=0)
        aper.after_task(task)
    x = rt.test_tf(torch.cat([split.x for split in rt.benchmark.test]))
    logits = ease.predict(x, None)
    torch.testing.assert_close(logits, aper.eval().predict(x, None), rtol=1e-5, atol=1e-6)
    phi = [ease.subspace_features(x, None), ease.subspace_features(x, 0)]
    features, labels = [], []
    for task in rt.benchmark.tasks:
        train_x = rt.test_tf(rt.benchmark.train[task.id].x)
        pretrained, adapted = ease.subspace_features(train_x, None), ease.subspace_features(train_x, 0)
        features.append({-1: pretrained, 0: adapted, **{k: pretrained for k in range(1, task.id + 1)}})
        labels.append(rt.benchmark.train[task.id].y)
    fc = ref.run_tasks(features, labels, init_cls=2, inc=2, out_dim=D, use_init_ptm=False, moni_adam=True,
                       adapter_num=1)[-1]  # fmt: skip
    code = ref.ease_logits(torch.cat([*phi, phi[0], phi[0]], 1), fc, cur_task=2, alpha=0.1, beta=0.0, init_cls=2,
                           inc=2, out_dim=D, use_init_ptm=True, moni_adam=True)  # fmt: skip
    assert torch.equal(code.argmax(1), logits.argmax(1))
    ratio = code / logits
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-4, atol=1e-5)
    assert ease.forwards_per_test_image() == {"til": 2, "cil": 2}
    assert [set(entry) for entry in ease.storage()["bits_per_task"]] == [{"adapter", "prototypes"}, {"prototypes"},
                                                                         {"prototypes"}]  # fmt: skip
    assert ease.extra_results()["ease"]["mode"].startswith("aper")


def test_a_task_trains_its_own_adapter_set_and_proxy_head_only() -> None:
    """At task 1: the optimizer holds set 1 and the proxy head (weight decay on all of them, as the code's SGD); one
    step moves only those; set 0, the backbone and the prototypes are untouched; the loss is the proxy CosineLinear's
    cross-entropy on the task's local labels (aux_targets)."""
    method, rt = build()
    task0, task1 = rt.benchmark.tasks[:2]
    method.before_task(task0)
    run_task(method, task0, rt, epochs=1)
    method.after_task(task0)
    method.before_task(task1)
    phase = method.phases(task1, 1)[0]
    method.before_phase(task1, phase)
    optimizer = build_optimizer(method, task1, phase, rt.cfg.trainer)
    assert all(group["weight_decay"] == 5e-4 for group in optimizer.param_groups)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in [*method.sets.parameters(1), *method.proxy.parameters()]}
    x, y = rt.benchmark.train[1].batch(None, 0, 16)
    method.eval()  # the adapter's dropout off, to compare
    loss, _ = method.training_loss(rt.test_tf(x), y, task1)
    with torch.no_grad():
        feats = method.subspace_features(rt.test_tf(x), 1)
    proxy = ref.cosine_linear(feats, method.proxy.weight, float(method.proxy.sigma.detach()))
    torch.testing.assert_close(loss, F.cross_entropy(proxy, y - task1.offset))
    method.train()
    before = {name: p.detach().clone() for name, p in method.named_parameters()}
    train_step(method, task1, rt, x, y, optimizer=optimizer, params=optimized(optimizer))
    named = dict(method.named_parameters())
    moved = {name for name, p in named.items() if not torch.equal(p, before[name])}
    assert moved and {id(named[name]) for name in moved} <= trained
    assert any(".sets.1." in name for name in moved) and "proxy.weight" in moved


def test_a_checkpoint_replay_restores_every_set_and_prototype_mid_task_too() -> None:
    """After two tasks and one step into the third (its proxy head and set mid-training): a fresh method walked to the
    same position by the loop's replay takes the state_dict back exactly, and predicts the same."""
    method, rt = build("trainer.epochs=1")
    one_step_into(method, rt, 2)
    state = method.state_dict()
    assert any("proxy" in k for k in state) and any(".sets.2." in k for k in state)
    assert_replays(method, build("seed=5", "trainer.epochs=1")[0], rt, 2)


def test_the_artifacts_are_the_prototypes_and_the_adapter_sets() -> None:
    """Not the pretrained backbone (unchanged): the heads and every set; test_run.py evaluates a finished run again
    from what a run saves of them."""
    method, _ = started(tasks=2)
    saved = method.artifacts()
    assert {k.split(".")[0] for k in saved} == {"head", "adapters"}
    assert {k.split(".")[1] for k in saved if k.startswith("adapters.")} == {"0", "1"}


def test_storage_counts_each_tasks_adapter_set_and_its_growing_prototypes() -> None:
    """Per task 32 · (2dr + r + d) bits a block for its set, and 32 · C_t · (t + 1) · d for its prototypes (the
    subspaces so far, every seen task's growing with each new one); trainable: the newest set and its proxy head."""
    method, rt = run_tasks("trainer.epochs=0")
    storage = method.storage()
    adapter = 2 * D * 8 + 8 + D  # one block (TINY: depth 1), r = 8
    for task, entry in zip(rt.benchmark.tasks, storage["bits_per_task"], strict=True):
        assert entry == {"adapter": 32 * adapter, "prototypes": 32 * task.num_classes * 3 * D}
    assert storage["trainable_params"] == adapter + 2 * D + 1
    assert method.forwards_per_test_image() == {"til": 3, "cil": 3}


@pytest.mark.parametrize(
    ("override", "key"),
    [("method.alpha=-0.1", "method.alpha"), ("method.beta=-1", "method.beta"), ("method.bottleneck=0",
     "method.bottleneck"), ("method.adapter_dropout=1.0", "method.adapter_dropout")],
)  # fmt: skip
def test_bad_values_are_refused_before_any_work(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        tiny_config("method=ease", override)


def test_unseen_classes_cannot_be_scored() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.cil_classes"):
        tiny_config("method=ease", "trainer.cil_classes=all")


@pytest.mark.parametrize(
    ("overrides", "cost"),
    [((), lambda t: t + 1), (("method.ptm_block=true",), lambda t: t + 2), (("method.aper_mode=true",), lambda t: 2)],
    ids=["ease", "ptm_block", "aper_mode"],
)
def test_a_test_image_costs_one_vit_forward_per_subspace_growing_with_the_tasks(
    overrides: tuple[str, ...], cost: Callable[[int], int]
) -> None:
    """After task t: t + 1 adapter sets (t + 2 subspaces with the pretrained ViT's); APER mode keeps [PTM; A_0]."""
    method, rt = build(*overrides)
    for task in rt.benchmark.tasks:
        method.before_task(task)
        assert method.forwards_per_test_image() == {"til": cost(task.id), "cil": cost(task.id)}, f"task {task.id}"
