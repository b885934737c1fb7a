"""HAT (Serra, Suris, Miron & Karatzoglou, ICML 2018): hard attention to the task.

Every gated unit u of task t has a gate a_u = sigmoid(s * e_u^t) over a learned task embedding e^t (init
N(0, 1)) that multiplies the unit's output. While training, s is annealed batch by batch within each
epoch from 1/s_max to s_max (Eq. 3; ``anneal=code``: the official code's (s_max - 1/s_max) i / N + 1/s_max with i the
batch's first sample of the epoch's N, which never reaches s_max: a lock-step check found it the one difference from the
official code); evaluation and mask extraction use s = s_max. After task t the
cumulative gates become a^{<=t} = max(a^t, a^{<t}).

Training task t > 0:
- the change of a weight is multiplied by m = 1 - min(a_out^{<t}, a_in^{<t}) of the units it connects (Eq. 2);
- the embedding's gradient is compensated, q' = s_max (cosh(s e) + 1) / (s (cosh(e) + 1)) q with |s e|
  clamped to ``thres_cosh``, and e is clamped to [-``thres_emb``, ``thres_emb``] after every step (Sec. 2.5);
- the loss adds ``c`` * R, R = sum_u a_u^t (1 - a_u^{<t}) / sum_u (1 - a_u^{<t}) (Eqs. 4-5).

ViT adaptation (a design choice; the paper used an AlexNet, and MEAT's HAT-on-ViT details are not public).
The residual stream is not gated (its gate is 1), so a weight's multiplier is 1 - a^{<t} of its one gated
unit. ``units`` picks the gated units of every block:
- ``mlp``: the hidden units of the MLP (after the activation): rows of ``mlp.fc1`` (and its bias),
  columns of ``mlp.fc2``;
- ``qkv``: the q/k/v output channels of ``attn.qkv``: rows of ``attn.qkv`` (and its bias); the v channels
  are the input units of ``attn.proj``, whose columns they protect;
- ``heads``: one gate per attention head on the attention output (before ``attn.proj``): the head's q/k/v
  rows of ``attn.qkv`` and its columns of ``attn.proj``. ``qkv`` and ``heads`` are alternatives.
Parameters every task shares (LayerNorms, patch and position embeddings, class token, the biases that
write into the residual stream, and any Linear whose units are not gated) learn with the first task only.

Eq. 2 multiplies the gradient, and the paper trains with plain SGD, where that is the same as multiplying
the update. clbench multiplies the update (w <- w_before + m (w_after - w_before)) and zeroes the gradient
where m = 0: identical to Eq. 2 under plain SGD, and it keeps momentum, Adam's normalisation and weight
decay from moving protected weights. Weights with m = 0 (a^{<t} = 1 in float32, the case for every unit
whose |e| is not near 0 at s_max = 400) stay bit-identical whatever the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.methods.base import Logs, Method, Phase

UNITS = ("mlp", "qkv", "heads")


@dataclass
class HATConfig:
    s_max: float = 400.0  # gate steepness at test time and the end of each annealing cycle (paper: 400)
    c: float = 0.75  # capacity regulariser weight (paper: 0.75)
    thres_cosh: float = 50.0  # clamp of |s e| in the gradient compensation (official code)
    thres_emb: float = 6.0  # clamp of the embeddings after each step (official code)
    units: list[str] = field(default_factory=lambda: ["mlp", "qkv"])  # gated units per block
    anneal: str = "paper"  # paper: Eq. 3, s_max at an epoch's last batch | code: the official, by sample index

    def __post_init__(self) -> None:
        require(self.s_max >= 1, "method.s_max", self.s_max, "a float >= 1")
        require(self.c >= 0, "method.c", self.c, "a float >= 0")
        require(self.thres_cosh > 0, "method.thres_cosh", self.thres_cosh, "a float > 0")
        require(self.thres_emb > 0, "method.thres_emb", self.thres_emb, "a float > 0")
        ok = bool(self.units) and set(self.units) <= set(UNITS) and not {"qkv", "heads"} <= set(self.units)
        require(
            ok, "method.units", self.units, "a non-empty subset of mlp, qkv, heads (qkv and heads exclude each other)"
        )
        require_choice("method.anneal", self.anneal, ("paper", "code"))


def annealed_s(batch: int, num_batches: int, s_max: float) -> float:
    """Eq. 3: s = 1/s_max + (s_max - 1/s_max) (b - 1) / (B - 1) for batch b = 1..B of the epoch (``batch`` = b - 1).
    An epoch of one batch trains at s_max, the end of the cycle, like the test."""
    if num_batches == 1:
        return s_max
    return 1 / s_max + (s_max - 1 / s_max) * batch / (num_batches - 1)


def code_annealed_s(first: int, samples: int, s_max: float) -> float:
    """The official code's s for the batch whose first sample is ``first`` of the epoch's ``samples``
    (joansj/hat, approaches/hat.py ``train_epoch``): (s_max - 1/s_max) first / samples + 1/s_max, which never reaches
    s_max in training."""
    return (s_max - 1 / s_max) * first / samples + 1 / s_max


def compensation(e: torch.Tensor, s: float | torch.Tensor, s_max: float, thres_cosh: float) -> torch.Tensor:
    """Sec. 2.5: the factor on the embedding gradient, s_max (cosh(s e) + 1) / (s (cosh(e) + 1))."""
    return s_max / s * (torch.cosh(torch.clamp(s * e, -thres_cosh, thres_cosh)) + 1) / (torch.cosh(e) + 1)


def capacity(gates: list[torch.Tensor], previous: list[torch.Tensor]) -> torch.Tensor:
    """Eq. 5: R = sum a^t (1 - a^{<t}) / sum (1 - a^{<t}) over all gated units."""
    num = sum((a * (1 - p)).sum() for a, p in zip(gates, previous, strict=True))
    den = sum((1 - p).sum() for p in previous)
    return num / den


class Gated(nn.Module):
    """Multiplies ``inner``'s output (``where="output"``) or input (``"input"``) by ``gate`` along the last
    dimension, ``gate`` repeated ``repeat`` times per unit (a head's channels); no gate: ``inner`` as is."""

    def __init__(self, inner: nn.Module, where: str, repeat: int = 1) -> None:
        super().__init__()
        self.inner, self.where, self.repeat = inner, where, repeat
        self.gate: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.inner(x)
        gate = self.gate.repeat_interleave(self.repeat).to(x.dtype)
        return self.inner(x * gate) if self.where == "input" else self.inner(x) * gate


@dataclass
class Protected:
    """A parameter whose slices along ``dim`` are guarded by units of gate ``gate``: slice i by unit
    ``index[i]``. A 2-D weight between two gated layers (CTR's adapters) names its input's gate in ``other`` (dim 0 the
    rows, ``other_index[j]`` the unit of column j): entry (i, j) is guarded by min(a[index[i]], a_other[other_index[j]])
    (Eq. 2)."""

    param: nn.Parameter
    gate: str
    dim: int
    index: torch.Tensor
    other: str | None = None
    other_index: torch.Tensor | None = None


class HAT(Method):
    Config = HATConfig
    task_conditioned = True
    soft_targets = True

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: HATConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.gated: dict[str, Gated] = {}  # by key, e.g. blocks_0_mlp
        self.units: dict[str, int] = {}
        self.protected: list[Protected] = []
        for i, block in enumerate(backbone.blocks):
            self._gate_block(f"blocks_{i}", block)
        device = backbone.cls_token.device
        for key, n in self.units.items():
            self.register_buffer(f"cum_{key}", torch.zeros(n, device=device))  # a^{<t}
        self.embeddings = nn.ModuleList()  # per task: a ParameterDict of e^t per gated layer
        # The annealed s of the current step: a device tensor written in place by before_step, so that a compiled or
        # CUDA-graph step reads the new value every step (a Python float would be baked into the graph).
        self.register_buffer("s", torch.tensor(config.s_max, device=device), persistent=False)
        self.epoch: tuple[int, int] | None = None  # (training samples, batch size) of the epoch in progress
        self._multipliers: list[torch.Tensor] = []  # per protected parameter, fixed during a task
        self._before: list[torch.Tensor] = []

    def _gate_block(self, prefix: str, block: nn.Module) -> None:
        """Wrap the block's gated modules and record which parameter slices each unit guards."""
        attn, mlp, arange = block.attn, block.mlp, torch.arange
        if "mlp" in self.config.units:
            key, hidden = f"{prefix}_mlp", mlp.fc1.out_features
            mlp.act = self.gated[key] = Gated(mlp.act, "output")
            self.units[key] = hidden
            self._protect(key, (mlp.fc1.weight, 0, arange(hidden)), (mlp.fc1.bias, 0, arange(hidden)))
            self._protect(key, (mlp.fc2.weight, 1, arange(hidden)))
        if "qkv" in self.config.units or "heads" in self.config.units:
            key, dim, heads = f"{prefix}_attn", attn.proj.in_features, attn.num_heads
            qkv, proj = attn.qkv, attn.proj
            if "qkv" in self.config.units:
                attn.qkv = self.gated[key] = Gated(qkv, "output")
                self.units[key] = 3 * dim
                rows, cols = arange(3 * dim), arange(2 * dim, 3 * dim)  # proj's inputs are the v channels
            else:
                attn.proj = self.gated[key] = Gated(proj, "input", repeat=dim // heads)
                self.units[key] = heads
                cols = arange(dim) // (dim // heads)
                rows = cols.repeat(3)  # a head's q, k and v rows
            self._protect(key, (qkv.weight, 0, rows), (qkv.bias, 0, rows), (proj.weight, 1, cols))

    def _protect(self, key: str, *entries: tuple[nn.Parameter | None, int, torch.Tensor]) -> None:
        for param, dim, index in entries:
            if param is not None:
                self.protected.append(Protected(param, key, dim, index.to(param.device)))

    # ----------------------------------------------------------------------------- gates
    def cumulative(self, key: str) -> torch.Tensor:
        return getattr(self, f"cum_{key}")

    def gates(self, task_id: int, s: float | torch.Tensor) -> dict[str, torch.Tensor]:
        """a^t = sigmoid(s e^t) per gated layer."""
        return {key: torch.sigmoid(s * e) for key, e in self.embeddings[task_id].items()}

    def multiplier(self, p: Protected) -> torch.Tensor:
        """1 - a^{<t} of each slice's unit, shaped to broadcast over the parameter (Eq. 2, residual gate 1)."""
        a = self.cumulative(p.gate)[p.index]
        if p.other is not None:
            return 1 - torch.minimum(a[:, None], self.cumulative(p.other)[p.other_index][None, :])
        return (1 - a)[:, None] if p.dim == 0 and p.param.dim() == 2 else 1 - a

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is None:
            raise ValueError("HAT needs a task id to pick its gates")
        s = self.s if self.training and task_id == self.num_seen - 1 else self.config.s_max
        gates = self.gates(task_id, s)
        for key, layer in self.gated.items():  # units without a layer (CTR's KS-layer gates) gate nothing
            layer.gate = gates[key]
        try:
            return super().features(x, task_id)
        finally:
            for layer in self.gated.values():
                layer.gate = None

    # ----------------------------------------------------------------------------- lifecycle
    def before_task(self, task: Task) -> None:
        super().before_task(task)
        self._add_embedding({key: torch.randn(n) for key, n in self.units.items()})  # N(0, 1), the paper's init

    def _add_embedding(self, values: dict[str, torch.Tensor]) -> None:
        device = self.backbone.cls_token.device
        self.embeddings.append(nn.ParameterDict({k: nn.Parameter(v.to(device)) for k, v in values.items()}))

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The head, e^t (no weight decay) and the gated layers' weights; every other backbone parameter with
        the first task only."""
        for t, (head, emb) in enumerate(zip(self.heads, self.embeddings, strict=True)):
            head.requires_grad_(t == task.id)
            emb.requires_grad_(t == task.id)
        guarded = {id(p.param) for p in self.protected}
        for p in self.backbone.parameters():
            p.requires_grad_(task.id == 0 or id(p) in guarded)
        backbone = [p for p in self.backbone.parameters() if p.requires_grad]
        self._multipliers = [self.multiplier(p) for p in self.protected]  # a^{<t} is fixed while task t trains
        return [
            {"params": list(self.heads[task.id].parameters())},
            {"params": list(self.embeddings[task.id].values()), "weight_decay": 0.0},
            {"params": backbone},
        ]

    def before_epoch(self, task: Task, samples: int, batch_size: int) -> None:
        self.epoch = (samples, batch_size)

    def before_step(self, task: Task, batch: int, num_batches: int) -> None:
        if self.config.anneal == "paper":
            self.s.fill_(annealed_s(batch, num_batches, self.config.s_max))
            return
        samples, batch_size = self.epoch or (num_batches, 1)  # without an epoch's sizes: batches of equal size
        self.s.fill_(code_annealed_s(batch * batch_size, samples, self.config.s_max))

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        ce = self.task_loss(self.heads[task.id](self.features(x, task.id)), y, task)
        keys = list(self.units)
        gates = self.gates(task.id, self.s)
        reg = capacity([gates[k] for k in keys], [self.cumulative(k) for k in keys])
        return ce + self.config.c * reg, {"capacity_reg": reg.detach()}

    @torch.no_grad()
    def after_backward(self, task: Task) -> None:
        cfg = self.config
        for e in self.embeddings[task.id].values():
            if e.grad is not None:
                e.grad.mul_(compensation(e, self.s, cfg.s_max, cfg.thres_cosh))
        if task.id == 0:
            return
        self._before = []
        for p, m in zip(self.protected, self._multipliers, strict=True):
            if p.param.grad is not None:
                p.param.grad.masked_fill_(m == 0, 0.0)
            self._before.append(p.param.detach().clone())

    @torch.no_grad()
    def after_step(self, task: Task) -> None:
        for e in self.embeddings[task.id].values():
            e.clamp_(-self.config.thres_emb, self.config.thres_emb)
        if task.id == 0:
            return
        for p, m, before in zip(self.protected, self._multipliers, self._before, strict=True):
            p.param.copy_(torch.where(m == 1, p.param, torch.lerp(before, p.param, m)))  # m = 0: exactly before
        self._before = []

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        super().after_task(task)
        for key, a in self.gates(task.id, self.config.s_max).items():
            self.cumulative(key).copy_(torch.maximum(a, self.cumulative(key)))
        self.embeddings[task.id].requires_grad_(False)

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: the head and the gates, binarised at s_max (1 bit per gated unit)."""
        out = super().storage()
        for entry in out["bits_per_task"]:
            entry["gates"] = sum(self.units.values())
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        out = super().artifacts()
        for t, emb in enumerate(self.embeddings):
            out |= {f"embedding.{t}.{key}": e.detach().clone() for key, e in emb.items()}
        return out | {f"cumulative.{key}": self.cumulative(key).clone() for key in self.units}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for t in range(self.num_seen):
            self._add_embedding({key: tensors[f"embedding.{t}.{key}"] for key in self.units})
        self.embeddings.requires_grad_(False)
        for key in self.units:
            self.cumulative(key).copy_(tensors[f"cumulative.{key}"])
