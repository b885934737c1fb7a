"""APER's rules (PTM spec part 1 §2.7) against an independent transcription of its official code
(tests/oracles/aper_reference.py): the two branches concatenated without per-branch normalisation, prototypes as class
means whatever the batch order, SimpleCIL's predictions while the module is at its initialisation, nothing but new
prototypes after the first task, two forwards per test image; and each of the four variants' first session."""

from __future__ import annotations

import pytest
import torch

from clbench.errors import ConfigError
from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import build_runtime
from clbench.loop.step import train_step
from clbench.loop.task import run_task
from clbench.methods.first_session import vit_features
from conftest import tiny_config, trained_task_by_task
from oracles import aper_reference as ref


def run_tasks(*overrides: str) -> tuple:
    cfg = tiny_config("method=aper", "method.bottleneck=8", *overrides)
    return trained_task_by_task(cfg)


def test_the_classifier_is_the_officials_prototypes_of_both_branches_concatenated() -> None:
    """After a trained first session and three tasks: the heads are replace_fc's class means of
    cat([phi_PTM, phi_adapted]) and the CIL logits MultiBranchCosineIncrementalNet's cosine (sigma 1); neither branch
    is normalised on its own, so scaling one branch changes the logits."""
    method, rt = run_tasks("trainer.epochs=2")
    backbone = method.backbone
    weight = None
    for task in rt.benchmark.tasks:
        x = rt.test_tf(rt.benchmark.train[task.id].x)
        with torch.no_grad(), method.first.petl.off():
            pretrained = vit_features(backbone, x)
        with torch.no_grad():
            adapted = vit_features(backbone, x)
        feats = ref.multibranch_features([pretrained, adapted]).double()
        weight = ref.update_fc(weight, task.offset + task.num_classes, feats.shape[1])
        weight = ref.replace_fc(weight, feats, rt.benchmark.train[task.id].y)
    heads = torch.cat([h.weight for h in method.heads])
    torch.testing.assert_close(heads, weight.float(), rtol=1e-5, atol=1e-6)
    x = rt.test_tf(rt.benchmark.test[1].x)
    with torch.no_grad():
        pretrained, adapted = method.first.pretrained_features(x), method.first.adapted_features(x)
    assert not torch.equal(pretrained, adapted)  # the session moved the adapter
    expected = ref.cosine_logits(ref.multibranch_features([pretrained, adapted]), heads)
    torch.testing.assert_close(method.predict(x, None), expected, rtol=1e-5, atol=1e-6)
    scaled = ref.cosine_logits(ref.multibranch_features([3 * pretrained, adapted]), heads)
    assert not torch.allclose(scaled, expected, atol=1e-4)


def test_with_its_module_at_initialisation_aper_predicts_as_simplecil() -> None:
    """No training step (epochs 0): the adapter's W_up = 0, the branches are equal, cos([a; a], [p; p]) = cos(a, p):
    APER's logits are SimpleCIL's on the same backbone."""
    aper, rt = run_tasks("trainer.epochs=0")
    simplecil, _ = build_runtime(tiny_config("method=simplecil"))
    for task in rt.benchmark.tasks:
        simplecil.before_task(task)
        run_task(simplecil, task, rt, epochs=0)
        simplecil.after_task(task)
    x = rt.test_tf(torch.cat([split.x for split in rt.benchmark.test]))
    torch.testing.assert_close(aper.predict(x, None), simplecil.eval().predict(x, None), rtol=1e-5, atol=1e-6)


def test_cosine_logits_are_fp32_under_autocast() -> None:
    from clbench.methods.parts.cosine import cosine_logits

    feats, weight = torch.randn(5, 16), torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = cosine_logits(feats, weight)
    assert inside.dtype == torch.float32 and torch.equal(inside, cosine_logits(feats, weight))
    torch.testing.assert_close(inside, ref.cosine_logits(feats, weight))


def test_a_prototype_is_the_class_mean_whatever_the_batch_order() -> None:
    method, rt = run_tasks("trainer.epochs=1", "data.num_tasks=1")
    task, split = rt.benchmark.tasks[0], rt.benchmark.train[0]
    x = rt.test_tf(split.x)
    expected = method.heads[0].weight.clone()
    for order in (torch.randperm(len(x), generator=torch.Generator().manual_seed(s)) for s in range(2)):
        method.before_phase(task, method.phases(task, 1)[-1])
        for chunk in order.split(7):
            method.observe(x[chunk], split.y[chunk], task, chunk)
        method.after_task(task)
        torch.testing.assert_close(method.heads[0].weight, expected, rtol=1e-6, atol=1e-7)


def test_after_the_first_task_nothing_changes_but_new_prototypes() -> None:
    """The backbone, the adapted module and the first task's prototypes are bit-identical after tasks 1 and 2: TIL
    forgetting is exactly 0."""
    cfg = tiny_config("method=aper", "method.bottleneck=8", "trainer.epochs=1")
    method, rt = build_runtime(cfg)
    x = rt.test_tf(rt.benchmark.test[0].x)
    states, logits = [], []
    for task in rt.benchmark.tasks:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
        states.append({k: v.numpy().tobytes() for k, v in method.state_dict().items() if not k.startswith("heads.")})
        logits.append(method.eval().predict(x, 0))
    assert states[0] == states[1] == states[2]
    assert torch.equal(logits[0], logits[2])


def test_a_test_image_costs_two_vit_forwards() -> None:
    method, rt = run_tasks("trainer.epochs=0", "data.num_tasks=2")
    assert method.forwards_per_test_image() == {"til": 2, "cil": 2}
    calls = []
    method.backbone.patch_embed.register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    x = rt.test_tf(rt.benchmark.test[1].x)
    method.predict_scenarios(x, 1, ("til", "cil"))
    assert calls == [len(x), len(x)]


@pytest.mark.parametrize("petl", ["adapter", "ssf", "vpt_deep", "vpt_shallow", "finetune"])
def test_each_variants_first_session_trains_its_module_and_the_cosine_head_only(petl: str) -> None:
    """One step of the first session moves the variant's parameters (the whole copy for finetune) and the head's
    sigma and weights, and nothing of the pretrained backbone; the optimizer decays every one of them (the code's
    SGD, weight_decay on all parameters)."""
    method, rt = build_runtime(tiny_config("method=aper", f"method.petl={petl}", "method.bottleneck=8"))
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    phase = method.phases(task, 1)[0]
    method.before_phase(task, phase)
    optimizer = build_optimizer(method, task, phase, rt.cfg.trainer)
    assert all(group["weight_decay"] == 5e-4 for group in optimizer.param_groups)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    before = {name: p.detach().clone() for name, p in method.named_parameters()}
    method.train()
    x, y = rt.benchmark.train[0].batch(None, 0, 16)
    loss, _ = train_step(method, task, rt, x, y, optimizer=optimizer, params=list(method.first.trained()))
    assert torch.isfinite(loss)
    moved = {name for name, p in method.named_parameters() if not torch.equal(p, before[name])}
    named = dict(method.named_parameters())
    assert moved and all(id(named[name]) in trained for name in moved)
    assert {"first.head.sigma", "first.head.weight"} <= moved
    assert not any(name.startswith("backbone.") and id(named[name]) not in trained for name in moved)
    if petl == "finetune":
        assert all(not p.requires_grad for p in method.backbone.parameters())
        assert {id(p) for p in method.first.tuned.parameters()} <= trained


def test_the_finetune_variants_pretrained_branch_is_the_untouched_backbone() -> None:
    method, rt = run_tasks("method.petl=finetune", "trainer.epochs=1", "data.num_tasks=1")
    fresh, _ = build_runtime(tiny_config("method=simplecil"))
    x = rt.test_tf(rt.benchmark.test[0].x)
    with torch.no_grad():
        assert torch.equal(method.first.pretrained_features(x), vit_features(fresh.backbone.eval(), x))
        assert not torch.equal(method.first.adapted_features(x), vit_features(fresh.backbone, x))
    assert method.storage()["shared_bits"]["adapted_module"] == 32 * sum(p.numel() for p in fresh.backbone.parameters())


def test_aper_needs_a_module_to_adapt() -> None:
    with pytest.raises(ConfigError, match=r"`method.petl`: 'none'"):
        tiny_config("method=aper", "method.petl=none")
