"""The optimizer and learning-rate schedule of one phase.

One optimizer over the method's parameter groups (AdamW, Adam or SGD, fused on CUDA; or BERT's AdamWeightDecayOptimizer,
:class:`AdamWBert`). On CUDA every group's learning
rate is a device tensor that the schedule fills in place, so a captured CUDA graph of the step reads the current rate
at every replay and the eager step never copies a rate to the device (:func:`rates_on_device`).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from clbench.config import TrainerConfig
from clbench.data import Task
from clbench.methods import Method
from clbench.methods.base import Phase


def build_optimizer(
    method: Method, task: Task, phase: Phase, cfg: TrainerConfig, *, capturable: bool = False
) -> torch.optim.Optimizer:
    """One optimizer over the method's groups for ``phase`` of ``task``. A group without ``weight_decay`` gets
    ``trainer.weight_decay`` except on biases, norms and position/class tokens; the batch-size scaling rule applies to
    every lr. A group's ``lr_factor`` sets its lr to that factor of ``trainer.lr`` (SLCA's backbone: 1/100 of the
    head's). On CUDA the optimizer is fused (its state and step count live on the device), and ``capturable`` where
    its step is captured in a CUDA graph (torch warns that it slows an uncaptured step)."""
    scale = cfg.batch_size / cfg.lr_scale_batch if cfg.lr_scale_batch else 1.0
    exempt = method.no_weight_decay_ids()
    final: list[dict[str, Any]] = []
    for given in method.param_groups(task, phase):
        group = {k: v for k, v in given.items() if k != "lr_factor"}
        params = [p for p in group["params"] if p.requires_grad]
        base = {**group, "lr": group.get("lr", cfg.lr * given.get("lr_factor", 1.0)) * scale}
        if "weight_decay" in group:
            final.append({**base, "params": params})
            continue
        decay = [p for p in params if id(p) not in exempt]
        free = [p for p in params if id(p) in exempt]
        final += [
            {**base, "params": decay, "weight_decay": cfg.weight_decay},
            {**base, "params": free, "weight_decay": 0.0},
        ]
    final = [g for g in final if g["params"]]
    if not final:
        raise RuntimeError(f"{type(method).__name__} returned no trainable parameters")
    cuda = all(p.is_cuda for g in final for p in g["params"])
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(final, lr=cfg.lr, momentum=cfg.momentum, **({"fused": True} if cuda else {}))
    if cfg.optimizer == "adamw_bert":
        return AdamWBert(final, lr=cfg.lr)
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return opt_cls(final, lr=cfg.lr, **({"fused": True, "capturable": capturable} if cuda else {}))


class AdamWBert(torch.optim.Optimizer):
    """BERT's and adapter-bert's AdamWeightDecayOptimizer (google-research/adapter-bert@1a31fc6 optimization.py
    L87-170): m ← β1 m + (1 − β1) g, v ← β2 v + (1 − β2) g², θ ← θ − lr (m / (√v + ε) + wd θ), with β = (0.9, 0.999)
    and ε = 1e-6, **without** Adam's bias correction (its first steps are larger than torch's AdamW's: 1 / (1 − β1^t)
    against √(1 − β2^t) / (1 − β1^t)). The weight decay is each group's, as torch's optimizers take it. Device ops only
    (a tensor learning rate is read in place): a CUDA graph replays its step."""

    def __init__(self, params: list[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None, "AdamWBert takes no closure"
        for group in self.param_groups:
            (b1, b2), eps, decay, lr = group["betas"], group["eps"], group["weight_decay"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = m / (v.sqrt() + eps)
                if decay:
                    update.add_(p, alpha=decay)
                p.sub_(update * lr)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A checkpoint's optimizer state, keeping how this optimizer was built (fused, capturable, foreach): a run may
    resume on another device, or with CUDA graphs turned on or off."""
    built = [{k: g[k] for k in ("fused", "capturable", "foreach") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, built, strict=True):
        group.update(flags)


def lr_factor(step: int, total: int, warmup: int, cfg: TrainerConfig, per_epoch: int = 1) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` (every step, or once an epoch of ``per_epoch`` steps with
    ``schedule_steps=epoch``; over ``cosine_epochs`` where set, rising again after them), a staircase ``lr_decay``
    each epoch (exponential: APD's x0.95) or at each of ``milestones`` (multistep: torch's MultiStepLR stepped per
    epoch, SLCA's), CODA-Prompt's quarter cosine (``coda_cosine``), or constant; a factor on each group's lr."""
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "coda_cosine":
        return coda_cosine((step - warmup) // per_epoch, (total - warmup) // per_epoch)
    if cfg.schedule == "exponential":
        return cfg.lr_decay ** ((step - warmup) // per_epoch)
    if cfg.schedule == "multistep":
        return cfg.lr_decay ** sum(step // per_epoch >= m for m in cfg.milestones)
    span = (cfg.cosine_epochs * per_epoch if cfg.cosine_epochs else total) - warmup
    if cfg.schedule != "cosine" or span <= 0:
        return 1.0
    done = step - warmup
    if cfg.schedule_steps == "epoch":
        done -= done % per_epoch
    floor = cfg.min_lr / cfg.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done / span))


def coda_cosine(epoch: int, epochs: int) -> float:
    """CODA-Prompt's ``CosineSchedule`` (utils/schedulers.py, InfLoRA's copy too): cos(99 pi e / (200 (K - 1))) of the
    scheduler's epoch e, which its loops step after each epoch but the first (CODA: ``if epoch > 0``; InfLoRA: at the
    end of each, from -1 at its construction), so epochs 0 and 1 both train at the full lr and the last at about 10%."""
    if epochs < 2:
        return 1.0
    return math.cos(99 * math.pi * max(epoch - 1, 0) / (200 * (epochs - 1)))


def rates_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make every group's learning rate a tensor on ``device`` (CUDA) holding its current value, after the optimizer
    and its schedule are built or loaded from a checkpoint; torch's schedulers then fill it in place. Elsewhere the
    rates stay floats."""
    if device.type != "cuda":
        return
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


@functools.cache
def schedulers_fill_tensor_rates() -> bool:
    """Whether this torch's learning-rate schedulers write a tensor rate in place (``fill_``) rather than replacing it
    with a float: a CUDA graph reads the tensor it captured, so a replaced one would freeze the rate."""
    rate = torch.tensor(1.0)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    optimizer.param_groups[0]["lr"] = rate
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no optimizer step is wanted here
        warnings.simplefilter("ignore")
        schedule.step()
    return optimizer.param_groups[0]["lr"] is rate and float(rate) == 0.5


def current_lr(schedule: torch.optim.lr_scheduler.LRScheduler) -> float:
    """The first group's learning rate as a float (a host sync where it is a device tensor: only when logged)."""
    return float(schedule.get_last_lr()[0])
