"""CTR (Ke, Liu, Ma, Xu & Shu, NeurIPS 2021): capsules and transfer routing, exact to the official code
(ZixuanKe/PyContinual src/networks/base/adapters.py, ``BertAdapterCapsuleMaskImp``) on a frozen ViT.

A CL-plugin sits on each residual branch of every block, after the attention and after the MLP:

    P(z) = z + g2 * ReLU(fc2(g1 * ReLU(fc1(z + KSM_t(z)))))          g1, g2 = sigmoid(s e^t): HAT's gates (the TSM)

The knowledge sharing module KSM_t: every task i <= t has its task capsule p_i = squash(W_i z + b_i) (3 values a
token), routed to 3 transfer capsules u_{j|i} = p_i R_{i,j}; a similarity estimator (Conv1d over the tokens with
kernels 3, 4, 5, conditioned on the current task's capsules) gives each task i a weight a_i (9 values) and a hard
gate delta_i (Gumbel-softmax in training, argmax at eval: the code also samples noise at eval, which makes its
predictions random); v = sum_{i<=t} a_i delta_i u_i, and a shared KS-layer (Linear 9 -> d) adds it to z.

Training reuses clbench's HAT (``methods/hat.py``): s annealed per batch (``anneal=code``: CTR's own
(s_max - 1/s_max) b / B + 1/s_max for batch b = 0..B-1 of the epoch's B), the embeddings' gradient compensation and
clamp, the capacity regulariser c R over every gate, and the gates' protection of fc1 (rows by g1), fc2 (entry (i, j)
by min(g2_i, g1_j)) and their biases. ``ks_gate=true`` is the code's ``elarger``: a third HAT gate per plugin, over
the KS-layer's d outputs, that multiplies nothing in the forward (``larger_as_share``) but enters R (its units count
in R's denominator: c is in effect (r + d) / (r + 2d) of its value once the gates close, 0.57 at ViT-Ti with r = 64,
0.78 at the code's BERT size), is compensated and clamped, and guards the KS-layer's rows; ``false`` leaves it out.
``ksm=shared`` is the code's: every task updates the capsules of all tasks <= t, the routing, the similarity estimator
and the KS-layer, so CTR forgets a little for the sake of transfer; ``ksm=frozen`` (clbench's ablation) trains only
the task's own capsule and routing, and the estimator and KS-layer with the first task only, for near-zero forgetting.

The code's recipe is not clbench's (conf/method/ctr.yaml): BertAdam (no bias correction, each parameter's gradient
clipped to norm 1, epsilon 1e-6, decoupled weight decay 0.01), lr 5e-5 with 10% linear warm-up then linear decay over
each task, and the weights of the epoch with the best validation loss kept per task.

ViT adaptation (design choices): plugins on timm's pre-norm blocks (P1 after ``attn``, P2 after ``mlp``), the whole
ViT frozen, LayerNorms included (the code trains BERT's LayerNorms in every task, which forgets); ``adapter_size``
units (the code's 2000 would equal the backbone); the code's reshapes that mix tokens, capsules and samples of a
batch are replaced by the paper's structure (each sample and token keeps its own capsules), and each task capsule is
squashed over its own 3 values (the code squashes across tasks, so untrained future tasks change the output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Task
from clbench.methods.base import Phase
from clbench.methods.hat import HAT, Gated, Protected

KERNELS = (3, 4, 5)  # the similarity estimator's Conv1d kernels (adapters.py Ks)
CAPSULE = 3  # semantic_cap_size: a task capsule's values, and the number of transfer capsules
SQUASH_EPS = 1e-16


@dataclass
class CTRConfig:
    s_max: float = 400.0  # [code: bert_adapter_mask_base.py]
    c: float = 0.75  # capacity regulariser weight (lamb) [code]
    thres_cosh: float = 50.0  # [code]
    thres_emb: float = 6.0  # [code]
    anneal: str = "code"  # code: s = (s_max - 1/s_max) batch / batches + 1/s_max [CTR's code] | paper: HAT's Eq. 3
    adapter_size: int = 64  # TSM bottleneck units [clbench's choice: the code's 2000 would equal ViT-B]
    channels: int = 100  # the similarity estimator's Conv1d channels a kernel size [code]
    ksm: str = "shared"  # shared: the code's (capsules, routing, estimator updated by later tasks) | frozen
    ksm_lr: float | None = 5e-5  # the KSM's learning rate [code: its one lr]; null: trainer.lr
    ks_gate: bool = True  # the code's elarger gates: in R, guarding the KS-layer, gating nothing [code] | false

    def __post_init__(self) -> None:
        require(self.s_max >= 1, "method.s_max", self.s_max, "a float >= 1")
        require(self.c >= 0, "method.c", self.c, "a float >= 0")
        require(self.thres_cosh > 0, "method.thres_cosh", self.thres_cosh, "a float > 0")
        require(self.thres_emb > 0, "method.thres_emb", self.thres_emb, "a float > 0")
        require_choice("method.anneal", self.anneal, ("paper", "code"))
        require(self.adapter_size >= 1, "method.adapter_size", self.adapter_size, "an integer >= 1")
        require(self.channels >= 1, "method.channels", self.channels, "an integer >= 1")
        require_choice("method.ksm", self.ksm, ("shared", "frozen"))
        require(self.ksm_lr is None or self.ksm_lr > 0, "method.ksm_lr", self.ksm_lr, "null or a float > 0")


def ctr_annealed_s(batch: int, num_batches: int, s_max: float) -> float:
    """CTR's s for batch ``batch`` (0-based) of an epoch's ``num_batches`` (PyContinual ``train_epoch``:
    (s_max - 1/s_max) step / len(data) + 1/s_max): by batch index, whatever the last batch's size."""
    return (s_max - 1 / s_max) * batch / num_batches + 1 / s_max


def squash(v: torch.Tensor) -> torch.Tensor:
    """The capsule non-linearity over the last axis: |v|^2 / (1 + |v|^2) v / |v| (``CapsuleLayerImp.squash``)."""
    norm2 = v.square().sum(-1, keepdim=True) + SQUASH_EPS
    return norm2 / (1 + norm2) * v / norm2.sqrt()


def hard_gate(logits: torch.Tensor, sample: bool) -> torch.Tensor:
    """Component 0 of a one-hot choice over the last axis: a straight-through Gumbel-softmax sample (training) or the
    argmax (evaluation)."""
    if sample:  # over (samples x tasks, 2): the same draws as on (B, T, 2), and no softmax that looks like attention's
        return F.gumbel_softmax(logits.reshape(-1, 2), tau=1.0, hard=True)[:, 0].view(logits.shape[:-1])
    return (logits[..., 0] >= logits[..., 1]).to(logits.dtype)


class KnowledgeSharing(nn.Module):
    """KSM: task capsules, transfer routing with the similarity estimator and hard gate, and the shared KS-layer."""

    def __init__(self, dim: int, tasks: int, channels: int) -> None:
        super().__init__()
        self.capsules = nn.ModuleList(nn.Linear(dim, CAPSULE) for _ in range(tasks))  # TK-layer, one a task
        # R_i (j, c, k): task i's capsule value c -> transfer capsule j's value k (route_weights, randn as the code)
        self.routes = nn.ParameterList(nn.Parameter(torch.randn(CAPSULE, CAPSULE, CAPSULE)) for _ in range(tasks))
        routed = CAPSULE * CAPSULE
        self.current = nn.ModuleList(nn.Conv1d(routed, channels, k, padding=k - 2) for k in KERNELS)
        self.per_task = nn.ModuleList(nn.Conv1d(routed, channels, k) for k in KERNELS)
        self.mix = nn.Linear(len(KERNELS) * channels, channels)  # fc_cur
        self.weigh = nn.Linear(len(KERNELS) * channels, routed)  # fc_sim: a_i
        self.gate = nn.Linear(len(KERNELS) * channels, 2)  # convs4, a Conv1d(., 2, 1) on one position
        self.out = nn.Linear(routed, dim)  # the KS-layer ``larger``, shared by all tasks
        self.task: int | None = None

    def estimator(self) -> list[nn.Parameter]:
        """The similarity estimator and the KS-layer: shared by every task."""
        modules = (self.current, self.per_task, self.mix, self.weigh, self.gate, self.out)
        return [p for m in modules for p in m.parameters()]

    def own(self, task: int) -> list[nn.Parameter]:
        """Task ``task``'s capsule and routing."""
        return [*self.capsules[task].parameters(), self.routes[task]]

    def similarity(self, u: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each task's weight a_i (B, T, 9) and hard gate delta_i (B, T) from the routed vectors u (B, N, T, 9)."""
        b, n, tasks, routed = u.shape
        tokens = u.permute(0, 2, 3, 1)  # (B, T, 9, N): the tokens on the convolution's axis
        cur = torch.cat([F.relu(conv(tokens[:, t])).amax(-1) for conv in self.current], 1)
        mix = self.mix(cur).repeat_interleave(tasks, 0)[:, :, None]  # (B T, C, 1)
        flat = tokens.reshape(b * tasks, routed, n)
        z = torch.cat([F.relu(conv(flat) + mix).amax(-1) for conv in self.per_task], 1).view(b, tasks, -1)
        return self.weigh(z), hard_gate(self.gate(z), sample=self.training)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.task is None:
            raise RuntimeError("CTR's KSM needs a task id")
        t = self.task
        caps = squash(torch.stack([c(z) for c in self.capsules[: t + 1]], 2))  # (B, N, t+1, 3)
        u = torch.einsum("bnic,ijck->bnijk", caps, torch.stack(list(self.routes[: t + 1])))  # (B, N, t+1, 3, 3)
        u = u.flatten(3)
        a, delta = self.similarity(u, t)
        v = ((a * delta[..., None])[:, None] * u).sum(2)  # (B, N, 9)
        return self.out(v)


class Plugin(nn.Module):
    """CTR's CL-plugin: z + TSM(z + KSM(z)), the TSM's two layers gated by HAT (``Gated``)."""

    def __init__(self, dim: int, tasks: int, config: CTRConfig) -> None:
        super().__init__()
        self.ksm = KnowledgeSharing(dim, tasks, config.channels)
        self.fc1, self.fc2 = nn.Linear(dim, config.adapter_size), nn.Linear(config.adapter_size, dim)
        self.tsm1 = Gated(nn.Sequential(self.fc1, nn.ReLU()), "output")
        self.tsm2 = Gated(nn.Sequential(self.fc2, nn.ReLU()), "output")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.tsm2(self.tsm1(z + self.ksm(z)))


class Plugged(nn.Module):
    """A block's sub-layer (``attn`` or ``mlp``) followed by a plugin on its output."""

    def __init__(self, inner: nn.Module, plugin: Plugin) -> None:
        super().__init__()
        self.inner, self.plugin = inner, plugin

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.plugin(self.inner(x, *args, **kwargs))


class CTR(HAT):
    Config = CTRConfig

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.plugins = [m for m in self.backbone.modules() if isinstance(m, Plugin)]

    def _gate_block(self, prefix: str, block: nn.Module) -> None:
        """Plug P1 after the attention and P2 after the MLP, and register their HAT gates and guarded weights."""
        dim, tasks = self.backbone.embed_dim, len(self.tasks)
        device = self.backbone.cls_token.device
        for name in ("attn", "mlp"):
            plugin = Plugin(dim, tasks, self.config).to(device)
            setattr(block, name, Plugged(getattr(block, name), plugin))
            g1, g2 = f"{prefix}_{name}_fc1", f"{prefix}_{name}_fc2"
            self.gated[g1], self.gated[g2] = plugin.tsm1, plugin.tsm2
            hidden = self.units[g1] = plugin.fc1.out_features
            self.units[g2] = dim
            rows1, rows2 = torch.arange(hidden, device=device), torch.arange(dim, device=device)
            self.protected += [
                Protected(plugin.fc1.weight, g1, 0, rows1),
                Protected(plugin.fc1.bias, g1, 0, rows1),
                Protected(plugin.fc2.weight, g2, 0, rows2, other=g1, other_index=rows1),
                Protected(plugin.fc2.bias, g2, 0, rows2),
            ]
            if self.config.ks_gate:  # the code's elarger: a gate with no layer, over the KS-layer's rows
                ks = f"{prefix}_{name}_ks"
                self.units[ks] = dim
                self.protected += [
                    Protected(plugin.ksm.out.weight, ks, 0, rows2),
                    Protected(plugin.ksm.out.bias, ks, 0, rows2),
                ]

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        for plugin in self.plugins:
            plugin.ksm.task = task_id
        try:
            return super().features(x, task_id)
        finally:
            for plugin in self.plugins:
                plugin.ksm.task = None

    def before_step(self, task: Task, batch: int, num_batches: int) -> None:
        if self.config.anneal == "code":
            self.s.fill_(ctr_annealed_s(batch, num_batches, self.config.s_max))
        else:
            super().before_step(task, batch, num_batches)

    def knowledge_parameters(self, task_id: int) -> list[nn.Parameter]:
        """What task ``task_id`` trains of the KSMs: ``shared``, every capsule and routing of tasks <= t with the
        estimator and KS-layer; ``frozen``, its own capsule and routing (the estimator and KS-layer with task 0)."""
        out: list[nn.Parameter] = []
        for plugin in self.plugins:
            ksm = plugin.ksm
            if self.config.ksm == "shared":
                out += [p for i in range(task_id + 1) for p in ksm.own(i)] + ksm.estimator()
            else:
                out += ksm.own(task_id) + (ksm.estimator() if task_id == 0 else [])
        return out

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The head, e^t (no weight decay), the TSMs (their guarded entries held by HAT's masks) and the KSM's share;
        the ViT is frozen."""
        self.requires_grad_(False)
        t = task.id
        adapters = [p for plugin in self.plugins for p in (*plugin.fc1.parameters(), *plugin.fc2.parameters())]
        groups = [
            {"params": list(self.heads[t].parameters())},
            {"params": list(self.embeddings[t].values()), "weight_decay": 0.0},
            {"params": adapters},
            {"params": self.knowledge_parameters(t)}
            | ({"lr": self.config.ksm_lr} if self.config.ksm_lr is not None else {}),
        ]
        for group in groups:
            for p in group["params"]:
                p.requires_grad_(True)
        self._multipliers = [self.multiplier(p) for p in self.protected]
        return groups

    def storage(self) -> dict[str, Any]:
        """Per task: HAT's gates (1 bit a unit at s_max), its capsules and routing (32 bits a value), its head."""
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            entry["capsules"] = 32 * sum(p.numel() for plugin in self.plugins for p in plugin.ksm.own(t))
        return out
