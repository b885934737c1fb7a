"""Adapter: Houlsby bottleneck adapters, one set per task, over a frozen pretrained ViT (MEAT Table 1's "Adaptor").

Houlsby et al., "Parameter-Efficient Transfer Learning for NLP" (ICML 2019), §2 and Fig. 2; official code
google-research/adapter-bert@1a31fc6 (modeling.py ``feedforward_adapter`` L321-360, the optimised variables
optimization.py L72-73); MEAT (Xue et al., CVPR 2022) §2.2 and Table 1 compare against it as "Adaptor-BERT".

An adapter is a bottleneck with an internal skip connection (Houlsby Eq. in §2.1, Fig. 2 right)::

    A(h) = h + W_up · φ(W_down · h + b_down) + b_up,    W_down: m x d,  W_up: d x m,

with φ the tanh-approximated GELU of BERT's code (adapter-bert modeling.py ``gelu``), both weights drawn from a normal
of std ``init_std`` (1e-3) truncated at two standard deviations (TensorFlow's ``truncated_normal_initializer``) and
zero biases, so each adapter starts near the identity. It holds 2md + d + m parameters.

Placement in a timm ``Block`` (pre-norm; Houlsby's BERT is post-norm, so the adapter goes where Fig. 2 puts it: on the
sub-layer's output after its output projection, before the residual add) [clbench's choice]::

    x <- x + drop_path1(ls1(A1_t(attn(norm1_t(x)))))
    x <- x + drop_path2(ls2(A2_t(mlp(norm2_t(x)))))

and the final norm (``norm``, or ``fc_norm`` with average pooling) is ``norm_t``. ``per_block: 2`` is Houlsby's two
adapters per layer; ``per_block: 1`` keeps only the one after the MLP (MEAT §2.2: "two fully connected layers as an
adaptor in each layer"; its place is not given, after the FFN is clbench's choice, as Pfeiffer et al.'s AdapterFusion).
With ``task_norms`` each task has its own copies of every LayerNorm of the backbone, initialised from the pretrained
ones and trained with the adapters and the head (Houlsby §2.1: "new layer normalization parameters per task";
optimization.py L72-73), which keeps the pretrained model exact for task 0 in MEAT's setting.

Training (options for adapter-bert's own, which MEAT's Table 1 preset selects): ``trainer.optimizer=adamw_bert`` is its
AdamWeightDecayOptimizer (optimization.py L87-170: Adam without bias correction, ε 1e-6, weight decay added to the
update), ``method.head_init=bert`` its classifier's truncated-normal head (run_classifier.py L546-552); adapter-bert
trains adapters, norms and head at one learning rate (``method.adapter_lr=null``).

Per task t the method creates adapters, norms and head in ``before_task`` (deterministically, so a resumed run's
replay rebuilds them before the checkpoint is loaded); only those are optimised; ``after_task`` freezes them, so no
later task moves them: task-incremental forgetting is exactly 0. ``features(x, t)`` switches every wrapped sub-layer
to task t for one forward pass (a Python index on the wrappers, constant within a phase: the training step stays one
graph). Without a task id (class-incremental evaluation) the task is inferred by lowest entropy (base class).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.base import HEAD_INITS, Logs, Method, Phase, init_head
from clbench.methods.parts.bottleneck import Bottleneck


@dataclass
class AdapterConfig:
    bottleneck: int = 64  # m (Houlsby code default, modeling.py L321; MEAT's model size suggests 24, inferred)
    per_block: int = 2  # adapters per block: 2 (Houlsby: after attention and after the MLP) | 1 (after the MLP)
    task_norms: bool = True  # per-task LayerNorms initialised from the pretrained ones (Houlsby §2.1)
    init_std: float = 1e-3  # std of the truncated-normal adapter weights (Houlsby code: init_scale=1e-3)
    adapter_lr: float | None = None  # lr of adapters and norms (null: trainer.lr, the head's)
    head_init: str = "default"  # default: nn.Linear's | bert: N(0, 0.02) cut at 2 std, bias 0 (adapter-bert's)

    def __post_init__(self) -> None:
        require(isinstance(self.bottleneck, int) and self.bottleneck >= 1, "method.bottleneck", self.bottleneck,
                "an integer >= 1")  # fmt: skip
        require(self.per_block in (1, 2), "method.per_block", self.per_block, "1 or 2")
        std = self.init_std
        require(math.isfinite(std) and std > 0, "method.init_std", std, "a finite float > 0")
        lr = self.adapter_lr
        require(lr is None or (math.isfinite(lr) and lr > 0), "method.adapter_lr", lr, "null or a finite float > 0")
        require_choice("method.head_init", self.head_init, HEAD_INITS)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """BERT's tanh-approximated GELU (adapter-bert modeling.py ``gelu``)."""
    return F.gelu(x, approximate="tanh")


class HoulsbyAdapter(Bottleneck):
    """A(h) = h + W_up · GELU(W_down · h + b_down) + b_up (Houlsby §2.1; adapter-bert modeling.py L321-360)."""

    def __init__(
        self,
        dim: int,
        bottleneck: int,
        init_std: float,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, bottleneck, gelu_tanh, device=device, dtype=dtype)
        with torch.no_grad():
            for lin in (self.down, self.up):
                nn.init.trunc_normal_(lin.weight, std=init_std, a=-2 * init_std, b=2 * init_std)
                nn.init.zeros_(lin.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + super().forward(h)


class AdaptedSublayer(nn.Module):
    """A block's ``attn`` or ``mlp`` followed by the active task's adapter (none while ``task`` is None)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.adapters = nn.ModuleList()
        self.task: int | None = None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        h = self.inner(x, *args, **kwargs)
        return h if self.task is None else self.adapters[self.task](h)


class TaskNorm(nn.Module):
    """A norm layer with one copy per task (initialised from the pretrained one); the pretrained one while ``task``
    is None."""

    def __init__(self, pretrained: nn.Module) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.norms = nn.ModuleList()
        self.task: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pretrained(x) if self.task is None else self.norms[self.task](x)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


class Adapter(Method):
    Config = AdapterConfig
    task_conditioned = True
    changes_backbone = False  # the pretrained weights never change; adapters and norms are saved per task
    soft_targets = True

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: AdapterConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.backbone.requires_grad_(False)
        if not hasattr(backbone, "blocks") or not all(
            hasattr(b, "attn") and hasattr(b, "mlp") for b in backbone.blocks
        ):
            raise ConfigError(f"Invalid backbone for method=adapter: {type(backbone).__name__} has no timm Blocks.")
        self.sublayers: dict[str, AdaptedSublayer] = {}
        self.task_norms: dict[str, TaskNorm] = {}
        for i, block in enumerate(backbone.blocks):
            names = ("attn", "mlp") if config.per_block == 2 else ("mlp",)
            for name in names:
                wrapped = AdaptedSublayer(getattr(block, name))
                setattr(block, name, wrapped)
                self.sublayers[f"blocks.{i}.{name}"] = wrapped
            if config.task_norms:
                for name in ("norm1", "norm2"):
                    self._wrap_norm(block, name, f"blocks.{i}.{name}")
        if config.task_norms:
            for name in ("norm_pre", "norm", "fc_norm"):
                self._wrap_norm(backbone, name, name)

    def _wrap_norm(self, parent: nn.Module, attr: str, key: str) -> None:
        norm = getattr(parent, attr, None)
        if norm is not None and _has_params(norm):  # Identity norms (timm's norm with avg pooling) stay as they are
            wrapped = TaskNorm(norm)
            setattr(parent, attr, wrapped)
            self.task_norms[key] = wrapped

    def new_head(self, num_classes: int) -> nn.Linear:
        """A head initialised as ``method.head_init`` says."""
        head = super().new_head(num_classes)
        init_head(head, self.config.head_init)
        return head

    # ----------------------------------------------------------------------------- per-task state
    def _switches(self) -> list[AdaptedSublayer | TaskNorm]:
        return [*self.sublayers.values(), *self.task_norms.values()]

    def _add_task_modules(self) -> None:
        """Append one adapter per wrapped sub-layer and one copy of every pretrained norm: the next task's state."""
        like = self.backbone.cls_token
        dim = self.backbone.num_features
        cfg = self.config
        for sub in self.sublayers.values():
            sub.adapters.append(HoulsbyAdapter(dim, cfg.bottleneck, cfg.init_std, like.device, like.dtype))
        for norm in self.task_norms.values():
            fresh = copy.deepcopy(norm.pretrained).requires_grad_(True)
            norm.norms.append(fresh)

    def task_modules(self, task_id: int) -> tuple[list[nn.Module], list[nn.Module]]:
        """Task ``task_id``'s adapters and norms, in a fixed order."""
        return (
            [sub.adapters[task_id] for sub in self.sublayers.values()],
            [norm.norms[task_id] for norm in self.task_norms.values()],
        )

    def _freeze_task(self, task_id: int) -> None:
        adapters, norms = self.task_modules(task_id)
        for module in (*adapters, *norms, self.heads[task_id]):
            module.requires_grad_(False)

    def before_task(self, task: Task) -> None:
        super().before_task(task)
        self._add_task_modules()

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is None:
            raise ValueError("Adapter needs a task id to pick its adapters")
        switches = self._switches()
        for switch in switches:
            switch.task = task_id
        try:
            return super().features(x, task_id)
        finally:
            for switch in switches:
                switch.task = None

    # ----------------------------------------------------------------------------- training
    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The task's adapters and norms (``adapter_lr``) and its head (trainer.lr); nothing of earlier tasks."""
        adapters, norms = self.task_modules(task.id)
        own: dict[str, Any] = {"params": [p for m in (*adapters, *norms) for p in m.parameters()]}
        if self.config.adapter_lr is not None:
            own["lr"] = self.config.adapter_lr
        return [{"params": list(self.heads[task.id].parameters())}, own]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        return self.task_loss(self.heads[task.id](self.features(x, task.id)), y, task), {}

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        self._freeze_task(task.id)

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task, exact fp32 bits: adapters (2md + d + m each), per-task norms, head."""
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            adapters, norms = self.task_modules(t)
            entry["adapters"] = 32 * sum(p.numel() for m in adapters for p in m.parameters())
            entry["norms"] = 32 * sum(p.numel() for m in norms for p in m.parameters())
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        out = super().artifacts()
        for t in range(self.num_seen):
            for key, sub in self.sublayers.items():
                out |= {f"adapter.{t}.{key}.{k}": v.detach().clone() for k, v in sub.adapters[t].state_dict().items()}
            for key, norm in self.task_norms.items():
                out |= {f"norm.{t}.{key}.{k}": v.detach().clone() for k, v in norm.norms[t].state_dict().items()}
        return out

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for t in range(self.num_seen):
            self._add_task_modules()
            for prefix, modules in (("adapter", self.sublayers), ("norm", self.task_norms)):
                for key, switch in modules.items():
                    module = switch.adapters[t] if prefix == "adapter" else switch.norms[t]
                    head = f"{prefix}.{t}.{key}."
                    module.load_state_dict({k.removeprefix(head): v for k, v in tensors.items() if k.startswith(head)})
            self._freeze_task(t)
