"""EWC (Kirkpatrick et al., PNAS 2017) and online EWC (Schwarz et al., ICML 2018): full fine-tuning plus a quadratic
penalty that anchors every parameter to its value after earlier tasks, weighted by the diagonal Fisher information.

Rules (the reference codes cited below; the ViT form is clbench's choice):

- Offline EWC: while training task t, L(θ) = L_t(θ) + s λ Σ_{k<t} Σ_i F_{k,i} (θ_i − θ*_{k,i})², one penalty per past
  task, θ*_k the parameters after task k, F_k the diagonal Fisher at θ*_k on task k's data
  [code:GMvandeVen/continual-learning@e6d795a models/cl/continual_learner.py L296-304, L317-331]; s = ½ with
  ``half`` (Kirkpatrick, GMvandeVen), 1 without (mammoth).
- Online EWC: one running Fisher F̃_t = γ F̃_{t−1} + F_t and one anchor θ* = θ after task t; penalty
  s λ γ Σ_i F̃_{t−1,i} (θ_i − θ*_i)²: γ is applied once more when the penalty is read, as GMvandeVen reads Schwarz et al.
  [continual_learner.py L74, L299-301, L327, L331]. mammoth's online EWC is ``half=false, gamma=1`` (with γ = 1 the two
  readings agree) [code:aimagelab/mammoth@cb9a36d models/ewc_on.py L37-42, L70-80].
- Offline without T copies (clbench's): the sum over tasks is kept as A = Σ_k F_k and the Fisher-weighted mean anchor
  μ = B/A (B = Σ_k F_k θ*_k), plus the scalar R = Σ_i (C_i − B_i²/A_i) (C = Σ_k F_k θ*_k²), so that
  Σ_k F_k (θ − θ*_k)² = A (θ − μ)² + (C − B²/A) exactly. (A, μ, R) carries the same information as (A, B, C) (B = Aμ,
  C = Aμ² + R elementwise) but is updated by the weighted Welford step A' = A + F, μ' = μ + (F/A')(θ* − μ),
  R' = R + Σ A F/A' (θ* − μ)², which never subtracts two large numbers (C − B²/A in float32 cancels): the penalty is
  exactly 0 at θ = θ*_0 after one task, and its gradient 2 s λ A (θ − μ) is 0 at θ = μ.

Fisher (the codes' estimators; where and how it is computed is clbench's choice): F = (1/N) Σ_x e(x), one per-example
estimate e over the task's N training images, computed in an ``observe`` phase named ``fisher`` after ``train``: eval
mode (no dropout or drop path), the test transform (no augmentation), fp32, per-example gradients g_c = ∇_θ log p_θ(c|x)
by ``torch.func`` (functional_call + vmap(grad)) in chunks of ``fisher_chunk`` examples. The output set O is the seen
classes (``loss_scope=seen``) or the task's head (``loss_scope=task``). Estimators (``fisher``):

- ``sample`` (default): g_ĉ², ĉ ~ p_θ(·|x): an unbiased one-sample estimate of the true Fisher of Kirkpatrick et al.
  at the cost of one backward per example (GMvandeVen ``sample``; FACIL ``multinomial``); clbench's choice.
- ``true_label``: g_y², the empirical Fisher (GMvandeVen ``true``).
- ``expected``: Σ_{c∈O} p_c g_c², the exact true Fisher (GMvandeVen's default ``all``): |O| backwards per example.
- ``mammoth``: p_y g_y² (mammoth's ewc_on.py L50-58), for mammoth-style runs.

Normalisation (``fisher_divisor``): by N, the number of examples (``examples``; not GMvandeVen's n−1 nor FACIL's
batches × batch size), or by ⌈N/B⌉·B, the batches times the batch size (``mammoth``: ewc_on.py L60,
``len(train_loader) * batch_size``; 0.5% smaller at real task sizes). The sums live in device tensors handed to the loop
by :meth:`EWC.observations`, so a multi-process run adds them up over its ranks.

Stability (:meth:`EWC.check_steps`). The penalty s λ r Σ_i A_i (θ_i − μ_i)² (r = γ online, 1 offline) has the diagonal
curvature h_i = 2 s λ r A_i, to which SGD's coupled weight decay adds wd. Heavy-ball SGD (torch's: v ← μ v + g,
θ ← θ − η v) on a quadratic of curvature h is the recursion e_{k+1} = (1 + μ − η h) e_k − μ e_{k−1}, whose roots stay
inside the unit circle iff 0 < η h < 2 (1 + μ) (μ < 1); the task's loss only adds positive curvature (its Hessian is
positive semi-definite near a minimum, so the largest eigenvalue of the sum is at least the penalty's). So a step of
learning rate η (the group's, with the batch scaling: every schedule's factor is at most 1) diverges along the
stiffest anchored parameter once η (2 s λ r max A + wd) ≥ 2 (1 + μ); gradient clipping then only bounds the
oscillation, and the clipped steps are the penalty's, not the task's. The check runs before every training phase of
a task that has an anchor (the Fisher is known only after a task) and refuses the phase with the largest λ and η that
would train. Adam and AdamW normalise each coordinate's step (≈ η whatever the curvature): no such bound; their runs
are checked for a penalty weight s λ r that fp32 cannot hold (the configuration alone decides that, before any work:
``method.lam=1e300``).

Parameters: every trainable parameter that has an anchor: the backbone (all of it: patch embedding, class token,
position embedding, blocks with their LayerNorms, final norm; unless ``freeze_backbone``) and the heads of past tasks;
the current head has none. The Fisher of the heads and of the backbone is kept in buffers created at construction
(backbone) and in ``before_task`` (each head, zero until its task ends), so a resumed run's replay gives them their
shapes before the checkpoint loads their values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from clbench.config import TrainerConfig, require, require_choice
from clbench.data import Task
from clbench.errors import ConfigError
from clbench.methods.base import Logs, Phase
from clbench.methods.finetune import Finetune, FinetuneConfig

ESTIMATORS = ("sample", "true_label", "expected", "mammoth")


@dataclass
class EWCConfig(FinetuneConfig):
    """EWC's hyperparameters on top of finetune's ``loss_scope`` and ``freeze_backbone``."""

    lam: float = 1.0e6  # λ, the penalty's weight (conf/method/ewc.yaml: measured on the embedded default)
    online: bool = False  # false: offline EWC (one penalty per past task) | true: online EWC (running Fisher)
    gamma: float = 1.0  # online: decay of the running Fisher (γ = 1: no decay)
    half: bool = True  # true: (λ/2) Σ F (θ − θ*)² (Kirkpatrick, GMvandeVen) | false: λ Σ F (θ − θ*)² (mammoth)
    fisher: str = "sample"  # sample | true_label | expected | mammoth (see the module docstring)
    fisher_chunk: int = 16  # examples per vmap'd per-example-gradient call (memory: chunk x parameters floats)
    fisher_divisor: str = "examples"  # examples: F = sums / N | mammoth: sums / (⌈N/B⌉·B), its len(loader) x batch

    def __post_init__(self) -> None:
        super().__post_init__()
        require(math.isfinite(self.lam) and self.lam >= 0, "method.lam", self.lam, "a finite float >= 0")
        require(math.isfinite(self.gamma) and 0 < self.gamma <= 1, "method.gamma", self.gamma, "a float in (0, 1]")
        require(
            self.weight() <= FP32_MAX,
            "method.lam",
            self.lam,
            f"a float whose penalty weight s·λ·γ ({self.weight():.3g} here) fp32 can hold (at most {FP32_MAX:.3g})",
        )
        require_choice("method.fisher_divisor", self.fisher_divisor, ("examples", "mammoth"))
        require_choice("method.fisher", self.fisher, ESTIMATORS)
        require(
            isinstance(self.fisher_chunk, int) and self.fisher_chunk >= 1,
            "method.fisher_chunk",
            self.fisher_chunk,
            "an integer >= 1",
        )

    def weight(self) -> float:
        """s λ r: the factor of Σ A (θ − μ)² in the penalty (s = ½ with ``half``, r = γ online)."""
        return self.lam * (0.5 if self.half else 1.0) * (self.gamma if self.online else 1.0)


FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_TINY = float(torch.finfo(torch.float32).tiny)


def sgd_bound(momentum: float) -> float:
    """Heavy-ball SGD on a quadratic of curvature h is stable iff η h < 2 (1 + μ) (module docstring)."""
    return 2 * (1 + momentum)


def buffer_name(name: str) -> str:
    """A parameter's name as a buffer name (buffers cannot hold dots)."""
    return name.replace(".", "__")


class _Logits(nn.Module):
    """The method's logits over the Fisher's output set, as a module that ``functional_call`` can run."""

    def __init__(self, method: EWC, task: Task) -> None:
        super().__init__()
        self.method, self.task_id, self.scope = method, task.id, method.config.loss_scope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.method.features(x, self.task_id)
        if self.scope == "task":
            return self.method.heads[self.task_id](feats)
        return self.method.seen_logits(feats)


def per_example_fisher(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    estimator: str,
    chunk: int = 16,
    uniforms: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Σ_x e(x) over the examples ``x`` (labels ``y`` as indices into ``model``'s outputs) for each tensor of
    ``params`` (names as ``model.named_parameters`` gives them): e = g_ĉ² (``sample``), g_y² (``true_label``),
    Σ_c p_c g_c² (``expected``) or p_y g_y² (``mammoth``), g_c = ∇ log softmax(model(x))_c. fp32, eval behaviour is
    the caller's (``model.eval()``); per-example gradients by vmap(grad) over chunks of ``chunk`` examples. ``sample``
    draws ĉ by inverting p's CDF at ``uniforms`` (one per example; drawn here when not given)."""
    if estimator == "sample" and uniforms is None:
        uniforms = torch.rand(len(x), device=x.device)
    sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    detached = {n: p.detach() for n, p in params.items()}

    def log_prob(ps: dict[str, torch.Tensor], xi: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, ps, (xi[None],)).float()
        return F.log_softmax(logits, dim=1)[0].gather(0, c[None])[0]

    per_example = vmap(grad(log_prob), in_dims=(None, 0, 0))
    # fp32 throughout; the unfused attention (matmuls and a softmax), which vmap batches (the fused kernels have no
    # batching rule: vmap would loop over the examples)
    with torch.autocast(x.device.type, enabled=False), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        for start in range(0, len(x), chunk):
            xc, yc = x[start : start + chunk].float(), y[start : start + chunk]
            with torch.no_grad():
                probs = F.softmax(model(xc).float(), dim=1)
            if estimator == "expected":
                labels = [torch.full_like(yc, c) for c in range(probs.shape[1])]
                weights = [probs[:, c] for c in range(probs.shape[1])]
            elif estimator == "sample":
                assert uniforms is not None
                u = uniforms[start : start + chunk, None].to(probs.dtype)
                drawn = torch.searchsorted(probs.cumsum(1), u)[:, 0].clamp(max=probs.shape[1] - 1)
                labels, weights = [drawn], [torch.ones_like(probs[:, 0])]
            elif estimator == "true_label":
                labels, weights = [yc], [torch.ones_like(probs[:, 0])]
            else:  # mammoth
                labels, weights = [yc], [probs.gather(1, yc[:, None])[:, 0]]
            for c, w in zip(labels, weights, strict=True):
                grads = per_example(detached, xc, c)
                for n, g in grads.items():
                    sums[n] += torch.einsum("b,b...->...", w, g.float().square())
    return sums


class EWC(Finetune):
    """Finetune plus the EWC penalty; ``importance.<p>`` holds A (offline: Σ_k F_k; online: F̃) and ``anchor.<p>`` μ
    (offline: the Fisher-weighted mean of the θ*_k; online: θ*) for each anchored parameter ``p``, ``residual`` the
    offline constant R."""

    Config = EWCConfig

    def __init__(self, backbone, benchmark, config: EWCConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.backbone.requires_grad_(not config.freeze_backbone)
        self.importance = nn.Module()
        self.anchor = nn.Module()
        self.register_buffer("residual", torch.zeros((), dtype=torch.float64, device=backbone.cls_token.device))
        for name, p in self.backbone.named_parameters():
            if p.requires_grad:
                self._add_anchor(f"backbone.{name}", p)
        self.sums: dict[str, torch.Tensor] | None = None  # the Fisher's per-example sums while a task is observed
        self.count: torch.Tensor | None = None
        self.batch = 1

    def _add_anchor(self, name: str, p: torch.Tensor) -> None:
        key = buffer_name(name)
        self.importance.register_buffer(key, torch.zeros_like(p, dtype=torch.float32).detach())
        self.anchor.register_buffer(key, torch.zeros_like(p, dtype=torch.float32).detach())

    def before_task(self, task: Task) -> None:
        super().before_task(task)
        for name, p in self.heads[task.id].named_parameters():
            self._add_anchor(f"heads.{task.id}.{name}", p)

    def anchored(self, task_id: int) -> list[tuple[str, nn.Parameter]]:
        """The parameters the penalty covers while training ``task_id``: the anchored backbone and heads < task_id."""
        out = [
            (f"backbone.{n}", p)
            for n, p in self.backbone.named_parameters()
            if hasattr(self.importance, buffer_name(f"backbone.{n}"))
        ]
        return out + [(f"heads.{k}.{n}", p) for k in range(task_id) for n, p in self.heads[k].named_parameters()]

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [Phase("train", epochs), Phase("fisher", 1, observe=True)]

    def before_phase(self, task: Task, phase: Phase) -> None:
        if phase.name != "fisher":
            return
        device = self.backbone.cls_token.device
        self.sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.anchored(task.id + 1)}
        self.count = torch.zeros((), dtype=torch.float32, device=device)
        self.batch = 1

    # ----------------------------------------------------------------------------- penalty
    def penalty(self, task_id: int) -> torch.Tensor:
        """s λ r (Σ_i A_i (θ_i − μ_i)² + R): s = ½ with ``half``, r = γ online (1 offline); no host sync."""
        total = self.residual.float()
        for name, p in self.anchored(task_id):
            key = buffer_name(name)
            a, mu = self.importance.get_buffer(key), self.anchor.get_buffer(key)
            total = total + (a * (p.float() - mu).square()).sum()
        return self.config.weight() * total

    @staticmethod
    def check_trainer(config: EWCConfig, trainer: TrainerConfig) -> None:
        """Under SGD, refuse a λ whose stability bound no Fisher fp32 resolves could meet: η · 2 s λ r · F < 2 (1 + μ)
        needs F below fp32's smallest normal number."""
        if trainer.optimizer != "sgd":
            return
        lr = trainer.lr * (trainer.batch_size / trainer.lr_scale_batch if trainer.lr_scale_batch else 1.0)
        largest = sgd_bound(trainer.momentum) / (lr * 2 * config.weight()) if config.weight() else math.inf
        require(
            largest >= FP32_TINY,
            "method.lam",
            config.lam,
            f"a float below {config.lam * largest / FP32_TINY:.3g} with trainer.optimizer=sgd and "
            f"trainer.lr={trainer.lr}: SGD stays stable only while lr x 2·s·λ·γ x max F < 2 (1 + trainer.momentum), "
            f"which would need every Fisher value under {largest:.3g}, below what fp32 resolves",
        )

    @torch.no_grad()
    def check_steps(self, task: Task, phase: Phase, optimizer: torch.optim.Optimizer) -> None:
        """SGD's stability bound on the penalty's curvature (module docstring): refuse the phase, before its first
        step, where η (2 s λ r max A + wd) ≥ 2 (1 + μ) for a group's anchored parameters."""
        if not isinstance(optimizer, torch.optim.SGD) or task.id == 0:
            return
        importance = {id(p): self.importance.get_buffer(buffer_name(n)) for n, p in self.anchored(task.id)}
        weight = self.config.weight()
        for group in optimizer.param_groups:
            fishers = [importance[id(p)] for p in group["params"] if id(p) in importance]
            if not fishers:
                continue
            top = max(float(a.max()) for a in fishers)
            lr, momentum, decay = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
            curvature = 2 * weight * top + decay
            bound = sgd_bound(momentum)
            if lr * curvature < bound:
                continue
            raise ConfigError(
                f"EWC cannot train task {task.id} with SGD: its penalty's curvature 2·s·λ·γ·max F + weight decay = "
                f"{curvature:.3g} (method.lam={self.config.lam:g}, max F={top:.3g} after task {task.id - 1}) times "
                f"the learning rate {lr:.3g} (trainer.lr with its batch scaling) is {lr * curvature:.3g}, at or beyond "
                f"SGD's stability bound 2 (1 + trainer.momentum) = {bound:.3g}: the steps along the stiffest anchored "
                f"parameters grow without bound (gradient clipping would only cap them, the task's loss unlearned). "
                f"Set method.lam below {max(bound / lr - decay, 0) / (2 * top * weight / self.config.lam):.3g} or "
                f"trainer.lr below {bound / curvature:.3g}."
            )

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        loss, logs = super().training_loss(x, y, task)
        if task.id == 0:  # no anchor yet
            return loss, logs
        penalty = self.penalty(task.id)
        return loss + penalty, {**logs, "ewc_penalty": penalty.detach()}

    # ----------------------------------------------------------------------------- Fisher
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """Add the per-example Fisher estimates of a batch (test transform, eval mode) to the task's sums."""
        assert self.sums is not None and self.count is not None  # set by before_phase
        cfg = self.config
        labels = y - task.offset if cfg.loss_scope == "task" else y
        model = _Logits(self, task)
        params = {f"method.{n}": p for n, p in self.anchored(task.id + 1)}
        # the sampled labels' uniforms drawn for the whole batch, this rank's rows taken: ranks draw as one process
        size, part = self.batch_share or (len(x), slice(None))
        uniforms = torch.rand(size, device=x.device)[part] if cfg.fisher == "sample" else None
        sums = per_example_fisher(
            model, params, x, labels, estimator=cfg.fisher, chunk=cfg.fisher_chunk, uniforms=uniforms
        )
        for name, s in sums.items():
            self.sums[name.removeprefix("method.")] += s
        self.count += len(y)
        self.batch = max(self.batch, size)  # the observe pass's batch size (its first batch is a whole one)

    def divisor(self) -> torch.Tensor:
        """What the Fisher's sums are divided by: N, or mammoth's ⌈N/B⌉·B."""
        assert self.count is not None
        count = self.count.clamp(min=1)
        if self.config.fisher_divisor == "examples":
            return count
        return torch.ceil(count / self.batch) * self.batch

    def observations(self) -> list[torch.Tensor]:
        if self.sums is None or self.count is None:
            return []
        return [*self.sums.values(), self.count]

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """F_t = sums / N; online: A ← γ A + F_t, μ ← θ; offline: the weighted Welford step of the module docstring.
        In a replay (no observe pass) F_t = 0: the checkpoint's values replace the result."""
        cfg = self.config
        residual = torch.zeros((), dtype=torch.float64, device=self.residual.device)
        for name, p in self.anchored(task.id + 1):
            key = buffer_name(name)
            a, mu = self.importance.get_buffer(key), self.anchor.get_buffer(key)
            theta = p.detach().float()
            if self.sums is not None and self.count is not None:
                fisher = self.sums[name] / self.divisor()
            else:
                fisher = torch.zeros_like(a)
            if cfg.online:
                a.mul_(cfg.gamma).add_(fisher)
                mu.copy_(theta)
                continue
            new_a = a + fisher
            w = torch.where(new_a > 0, fisher / new_a.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
            d = theta - mu
            residual += (a.double() * w.double() * d.double().square()).sum()
            mu.add_(w * d)
            a.copy_(new_a)
        self.residual += residual
        self.sums = self.count = None

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """The heads per task, plus the method-wide Fisher (A) and anchor (μ) kept for the anchored parameters, 32 bits
        each (and the 64-bit offline constant R)."""
        out = super().storage()
        floats = sum(b.numel() for b in self.importance.buffers())
        out["shared_bits"] = {"fisher": 32 * floats, "anchor": 32 * floats, "residual": 64}
        return out
