"""The seed tables' rows as their official codes compute them, where the presets of L2P's and MEAT's Table 1 name
those codes: each rule against an independent transcription of the code (tests/oracles/official_rules_reference.py)
on small tensors, with the settings read from the preset itself (so a preset that drops the official rule fails)."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import build_runtime
from clbench.methods.base import Phase, Replay
from conftest import compose_config, tiny_config
from oracles import official_rules_reference as ref

TRAIN = Phase("train", 1)
SGD = ("trainer.optimizer=sgd", "trainer.momentum=0.0", "trainer.weight_decay=0.0", "trainer.grad_clip=null")


def preset_keys(preset: str, *keys: str) -> tuple[str, ...]:
    """``key=value`` overrides of ``keys`` as the paper preset composes them."""
    cfg = compose_config(f"experiment={preset}")
    return tuple(f"{key}={OmegaConf.select(cfg, key)}" for key in keys)


# ------------------------------------------------------------------------------------------------------ ER and DER++
@pytest.mark.parametrize("method", ["er", "derpp"])
def test_er_and_derpp_under_the_l2p_presets_train_every_seen_head_as_the_l2p_code_does(method: str) -> None:
    """L2P Table 1's ER and DER++ rows (loss_scope from the preset): one head over the seen classes, the current rows
    masked to their task, the replayed rows over every seen class; after one SGD step at task 1 the backbone and BOTH
    heads are where the L2P code's step puts them (task 0's head moves: the replayed rows train it)."""
    lr = 0.5
    overrides = (f"method={method}", *preset_keys(f"l2p_table1_{method}_10", "method.loss_scope"), *SGD)
    m, rt = build_runtime(tiny_config(*overrides, f"trainer.lr={lr}"))
    t0, t1 = rt.benchmark.tasks[:2]
    m.before_task(t0)
    m.before_task(t1)
    torch.manual_seed(3)
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([2, 3, 3])
    x1, y1 = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 3, 2])
    x2, y2 = torch.randn(4, 3, 16, 16), torch.tensor([1, 0, 2, 2])
    z1, w1 = torch.randn(4, 4), torch.tensor([2, 4, 4, 2])
    replay = (Replay(x1, y1),) if method == "er" else (Replay(x1, y1, z1, w1), Replay(x2, y2, z1, w1))

    # the L2P code's step: one head (W, b) over the 4 seen classes, plain SGD on every tensor
    backbone = copy.deepcopy(m.backbone)
    W = torch.cat([m.heads[0].weight, m.heads[1].weight]).detach().clone().requires_grad_(True)
    b = torch.cat([m.heads[0].bias, m.heads[1].bias]).detach().clone().requires_grad_(True)
    logits = lambda images: backbone.forward_head(backbone.forward_features(images), pre_logits=True) @ W.T + b  # noqa: E731
    task = (t1.offset, t1.offset + t1.num_classes)
    if method == "er":
        loss = ref.l2p_code_loss(logits(torch.cat([x, x1])), torch.cat([y, y1]), len(y), task)
    else:
        alpha, beta = m.config.alpha, m.config.beta
        loss = (
            ref.l2p_code_loss(logits(x), y, len(y), task)
            + alpha * ref.per_row_mse(logits(x1), z1, w1)
            + beta * torch.nn.functional.cross_entropy(logits(x2), y2)
        )
    params = [*backbone.parameters(), W, b]
    *expected_backbone, W_new, b_new = ref.sgd_step(params, loss, lr)

    optimizer = build_optimizer(m, t1, TRAIN, rt.cfg.trainer)
    got_loss, _ = m.training_loss(x, y, t1, replay=replay)
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
    got_loss.backward()
    optimizer.step()
    torch.testing.assert_close(torch.cat([m.heads[0].weight, m.heads[1].weight]), W_new, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([m.heads[0].bias, m.heads[1].bias]), b_new, rtol=1e-5, atol=1e-6)
    for got, want in zip(m.backbone.parameters(), expected_backbone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------- LwF
class CapturedError(Exception):
    """Stops a run once the step under test has been looked at."""


def test_lwf_under_meat_mixing_distils_towards_the_teacher_on_the_students_own_mixed_input(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MEAT Table 1's LwF row mixes (mixup/cutmix from the preset): with the teacher the preset selects, the first step
    of task 1's training phase (after the warm-up moved the new head alone) distils towards the model as it was on the
    very input the student sees, so the distillation's gradient is zero (the reference codes' on-the-fly teacher: KD's
    gradient (softmax(z/T) - softmax(z_old/T)) / T vanishes at z = z_old; to rounding, since the backward of
    log-softmax recomputes the softmax its own way). A teacher recorded on the clean images pulls the mixed student
    (the previous preset: ~1e-2)."""
    from clbench.loop import train
    from clbench.methods.lwf import LwF

    keys = preset_keys("meat_table1_lwf", "method.teacher", "method.loss_scope", "trainer.mixup", "trainer.cutmix")
    seen: dict[str, object] = {}
    real = LwF.training_loss

    def spy(self: LwF, x: torch.Tensor, y: torch.Tensor, task, ids=None):
        if task.id == 1 and self.stage == "train":
            params = [p for p in self.parameters() if p.requires_grad]
            lam = self.config.lam
            total, _ = real(self, x, y, task, ids)
            self.config.lam = 0.0
            without, _ = real(self, x, y, task, ids)
            self.config.lam = lam
            both = zip(torch.autograd.grad(total, params), torch.autograd.grad(without, params), strict=True)
            kd_grad = [a - b for a, b in both]
            seen["mixed"] = y.is_floating_point()
            seen["kd_grad"] = max(float(g.abs().max()) for g in kd_grad)
            raise CapturedError
        return real(self, x, y, task, ids)

    monkeypatch.setattr(LwF, "training_loss", spy)
    with pytest.raises(CapturedError):
        train(tiny_config("method=lwf", *keys, "method.lam=1.0"), tmp_path)
    assert seen["mixed"], "the step under test was not mixed"
    assert seen["kd_grad"] < 1e-6, f"the distillation pulls the student at its first step: {seen['kd_grad']}"
