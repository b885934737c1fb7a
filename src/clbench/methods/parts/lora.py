"""Low-rank updates of a timm attention's fused q/k/v projection, as the LoRA continual-learning codes parametrise them
(SD-LoRA: q and v, WuYichen-97/SD-Lora-CL@8bacded backbone/lora.py ``_LoRA_qkv_timm_train`` L132-195; InfLoRA: k and
v, liangyanshuo/InfLoRA@e08b00e models/vit_inflora.py ``Attention_LoRA`` L189-249).

Every block's ``attn.qkv`` (d -> 3w) is wrapped. Its output keeps the pretrained projection and adds, to each target
third (q, k or v), the update of every component kept so far and of the one being trained::

    qkv(x) + [Δ_q x; Δ_k x; Δ_v x],    Δ = Σ_i s_i g_i B_i A_i + s B A

A_i in R^{r x d}, B_i in R^{w x r}: the frozen components, a bank of one slot a task (zeros until filled); g_i a fixed
gain per component and target (SD-LoRA's 1/(‖B_i‖_F ‖A_i‖_F), else 1); s_i one magnitude per component shared by
every block and target (SD-LoRA's trainable α_i; InfLoRA's 1); (A, B, s) the component being trained, initialised as
both codes do: A Kaiming-uniform (a = √5, U(±1/√d)), B = 0, so that the wrapped ViT is the pretrained one until B moves.

With gradients on (training) the update runs as the low-rank branch B (A x): the pretrained weight gets no gradient
and no d x 3w matrix is formed. Without gradients (evaluation, statistics passes) the components are merged into the
projection's weight once per batch, W + Δ, and the image's forward is the plain ViT's: one pass, whatever the number
of tasks. Attention around it is timm's own, on PyTorch's fused scaled-dot-product kernel.

With ``chosen`` set (a component index per sample: a bank slot, or the bank's size for the current component), each
sample takes the update of its one component alone, s_i g_i B_i A_i, as a batched low-rank branch (HiDe-LoRA's
per-sample LoRA slot, thu-ml/HiDe-Prompt@0ed4333 peft/lora/hide_lora.py L71-77); no weight is merged.

While ``recording`` is set the wrapper also sums the second moment of its input, Σ x x^T over every token, in fp64,
and counts the tokens (InfLoRA's statistics passes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.errors import ConfigError

TARGETS = ("q", "k", "v")


class Magnitudes(nn.Module):
    """s_i of the bank's slots and s of the current component, shared by every wrapped block: trainable parameters
    (SD-LoRA's α, all starting at ``init``) or fixed ones."""

    def __init__(self, slots: int, *, init: float, trainable: bool, device: torch.device | None = None) -> None:
        super().__init__()
        bank = torch.full((slots,), float(init), device=device)
        current = torch.tensor(float(init), device=device)
        if trainable:
            self.bank, self.current = nn.Parameter(bank), nn.Parameter(current)
        else:
            self.register_buffer("bank", bank)
            self.register_buffer("current", current)


class QKVLoRA(nn.Module):
    """A block's ``attn.qkv`` with the low-rank updates of :data:`TARGETS` ``targets``; ``qkv`` alone while
    ``active`` is False. ``a`` (n x r x d) and ``b`` (n x w x r) are the current component of each of the n targets;
    ``bank_a``, ``bank_b``, ``bank_gain`` the frozen ones, a slot a task."""

    def __init__(self, qkv: nn.Linear, targets: tuple[str, ...], rank: int, slots: int, magnitudes: Magnitudes) -> None:
        super().__init__()
        self.qkv = qkv
        self.thirds = [TARGETS.index(t) for t in targets]
        self.rank = rank
        self.width = qkv.out_features // 3
        n, d, w = len(targets), qkv.in_features, self.width
        like = {"device": qkv.weight.device, "dtype": qkv.weight.dtype}
        self.a = nn.Parameter(torch.empty(n, rank, d, **like))
        self.b = nn.Parameter(torch.zeros(n, w, rank, **like))
        self.register_buffer("bank_a", torch.zeros(slots, n, rank, d, **like))
        self.register_buffer("bank_b", torch.zeros(slots, n, w, rank, **like))
        self.register_buffer("bank_gain", torch.zeros(slots, n, **like))
        self.register_buffer("moment", None)  # Σ x x^T (fp64), allocated by start_recording
        self.register_buffer("tokens", None)
        self._magnitudes = (magnitudes,)  # held, not registered: the method owns it, every block reads it
        self.recording = False
        self.active = True
        self.chosen: torch.Tensor | None = None  # (B,) one component per sample (see the module's docstring)
        self.reset_current()

    # ----------------------------------------------------------------------------- the components
    @torch.no_grad()
    def reset_current(self) -> None:
        """A fresh current component: A Kaiming-uniform (a = √5) on each (r, d) target, B = 0."""
        for a in self.a:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.b.zero_()

    @torch.no_grad()
    def store(self, slot: int, gain: torch.Tensor) -> None:
        """Copy the current component into the bank's ``slot`` with its gain per target (n,)."""
        self.bank_a[slot].copy_(self.a)
        self.bank_b[slot].copy_(self.b)
        self.bank_gain[slot].copy_(gain)

    @torch.no_grad()
    def current_norms(self) -> torch.Tensor:
        """‖B‖_F ‖A‖_F of the current component, per target (n,)."""
        return torch.linalg.matrix_norm(self.b) * torch.linalg.matrix_norm(self.a)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every component of every target as one low-rank product: A_all (n(S+1)r x d), the scale of each of its rows
        (s_i g_i, then s for the current component) and B_all (3w x n(S+1)r), zero outside each target's third and
        component block, so that Δ = B_all diag(scale) A_all is (3w x d)."""
        magnitudes = self._magnitudes[0]
        n, r, w = len(self.thirds), self.rank, self.width
        a = torch.cat([self.bank_a, self.a[None]])  # (S+1, n, r, d)
        b = torch.cat([self.bank_b, self.b[None]])  # (S+1, n, w, r)
        scale = torch.cat([self.bank_gain * magnitudes.bank[:, None], magnitudes.current.expand(1, n)])  # (S+1, n)
        components = a.shape[0]
        a_all = a.transpose(0, 1).reshape(n * components * r, -1)
        scale_all = scale.T.repeat_interleave(r, dim=1).reshape(-1)
        columns = components * r
        rows = []
        for third in range(3):
            if third in self.thirds:
                k = self.thirds.index(third)
                block = b[:, k].permute(1, 0, 2).reshape(w, columns)  # (w, (S+1) r): component i at columns i r..
                rows.append(F.pad(block, (k * columns, (n - k - 1) * columns)))
            else:
                rows.append(b.new_zeros(w, n * columns))
        return a_all, scale_all, torch.cat(rows)

    def merged_weight(self) -> torch.Tensor:
        """W + Δ: the projection's weight with every component merged in (3w x d), in the weight's precision whatever
        the autocast around it."""
        with torch.autocast(self.qkv.weight.device.type, enabled=False):
            a_all, scale, b_all = self.factors()
            return self.qkv.weight + b_all @ (scale[:, None] * a_all)

    def selected(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each sample's update from its one component ``chosen[b]`` (B, N, 3w): s_i g_i B_i A_i x in each target's
        third, zeros in the others."""
        magnitudes = self._magnitudes[0]
        a = torch.cat([self.bank_a, self.a[None]])[chosen]  # (B, n, r, d)
        b = torch.cat([self.bank_b, self.b[None]])[chosen]  # (B, n, w, r)
        gain = torch.cat([self.bank_gain * magnitudes.bank[:, None], magnitudes.current.expand(1, len(self.thirds))])
        low = torch.einsum("bnd,bkrd->bknr", x, a.to(x.dtype))
        update = torch.einsum("bknr,bkwr->bknw", low, b.to(x.dtype)) * gain[chosen].to(x.dtype)[:, :, None, None]
        thirds = [x.new_zeros(*x.shape[:2], self.width)] * 3
        for k, third in enumerate(self.thirds):
            thirds[third] = update[:, k]
        return torch.cat(thirds, dim=-1)

    # ----------------------------------------------------------------------------- the forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recording:
            self.record(x)
        if not self.active:
            return self.qkv(x)
        if self.chosen is not None:
            return self.qkv(x) + self.selected(x, self.chosen)
        if not torch.is_grad_enabled():
            return F.linear(x, self.merged_weight(), self.qkv.bias)
        a_all, scale, b_all = self.factors()
        return self.qkv(x) + F.linear(F.linear(x, a_all) * scale, b_all)

    # ----------------------------------------------------------------------------- the input's second moment
    def start_recording(self) -> None:
        """Zero (allocating where needed) Σ x x^T and the token count, and record from the next forward."""
        d = self.qkv.in_features
        if self.moment is None:
            self.moment = torch.zeros(d, d, dtype=torch.float64, device=self.qkv.weight.device)
            self.tokens = torch.zeros((), dtype=torch.float64, device=self.qkv.weight.device)
        self.moment.zero_()
        self.tokens.zero_()
        self.recording = True

    @torch.no_grad()
    def record(self, x: torch.Tensor) -> None:
        with torch.autocast(x.device.type, enabled=False):
            flat = x.detach().reshape(-1, x.shape[-1]).double()
            self.moment.addmm_(flat.T, flat)
            self.tokens += flat.shape[0]

    def mean_moment(self) -> torch.Tensor | None:
        """(1/n) Σ x x^T over the n tokens recorded (the codes' ``cur_matrix``), None if none were."""
        if self.tokens is None or not int(self.tokens):
            return None
        return self.moment / self.tokens


class LoRA:
    """The wrappers :func:`attach` put on a ViT's blocks (held, not owned: they are the ViT's modules) and their
    magnitudes."""

    def __init__(self, wrappers: list[QKVLoRA], magnitudes: Magnitudes) -> None:
        self.wrappers = wrappers
        self.magnitudes = magnitudes

    def current(self) -> list[nn.Parameter]:
        """The current components' A and B of every block."""
        return [p for w in self.wrappers for p in (w.a, w.b)]

    def advance(self, slot: int, gains: list[torch.Tensor]) -> None:
        """Move each block's current component into ``slot`` (with its gains per target) and start a fresh one."""
        for wrapper, gain in zip(self.wrappers, gains, strict=True):
            wrapper.store(slot, gain)
            wrapper.reset_current()

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every component and magnitude, ``{prefix + name: copy}`` (a run's artifacts; not the pretrained weights)."""
        out = {f"{prefix}magnitudes.{k}": v for k, v in self.magnitudes.state_dict().items()}
        for i, wrapper in enumerate(self.wrappers):
            for name in ("a", "b", "bank_a", "bank_b", "bank_gain"):
                out[f"{prefix}{i}.{name}"] = getattr(wrapper, name)
        return {k: v.detach().clone() for k, v in out.items()}

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Copy :meth:`state`'s tensors back; every one must be there."""
        self.magnitudes.load_state_dict(
            {
                k.removeprefix(f"{prefix}magnitudes."): v
                for k, v in tensors.items()
                if k.startswith(f"{prefix}magnitudes.")
            }
        )
        for i, wrapper in enumerate(self.wrappers):
            for name in ("a", "b", "bank_a", "bank_b", "bank_gain"):
                getattr(wrapper, name).copy_(tensors[f"{prefix}{i}.{name}"])

    def numel_per_component(self) -> int:
        """Floats of one component over every block: (r d + w r) per target."""
        return sum(w.a.numel() + w.b.numel() for w in self.wrappers)

    def choose(self, chosen: torch.Tensor | None) -> None:
        """Every block's per-sample component (None: the sum of every component)."""
        for wrapper in self.wrappers:
            wrapper.chosen = chosen

    def activate(self, on: bool) -> None:
        """The updates on, or every block's pretrained projection alone."""
        for wrapper in self.wrappers:
            wrapper.active = on

    @property
    def recording(self) -> bool:
        return any(w.recording for w in self.wrappers)

    @recording.setter
    def recording(self, on: bool) -> None:
        for wrapper in self.wrappers:
            if on:
                wrapper.start_recording()
            else:
                wrapper.recording = False


def attach(
    vit: VisionTransformer,
    targets: tuple[str, ...],
    rank: int,
    slots: int,
    magnitudes: Magnitudes,
    *,
    blocks: list[int] | None = None,
) -> LoRA:
    """Wrap the fused ``attn.qkv`` of ``vit``'s ``blocks`` (None: every block) with :class:`QKVLoRA` (``slots`` bank
    slots, rank ``rank``); the pretrained weights are left as they were (the method freezes them)."""
    if not targets or any(t not in TARGETS for t in targets) or len(set(targets)) != len(targets):
        raise ValueError(f"LoRA targets {targets!r}: distinct ones of {', '.join(TARGETS)}")
    wrappers = []
    for i, block in enumerate(vit.blocks):
        if blocks is not None and i not in blocks:
            continue
        qkv = getattr(getattr(block, "attn", None), "qkv", None)
        if not isinstance(qkv, nn.Linear) or qkv.out_features != 3 * block.attn.num_heads * block.attn.head_dim:
            raise ConfigError(
                f"Invalid backbone for LoRA on q/k/v: block {i} has no fused qkv projection (timm's Attention)."
            )
        wrapper = QKVLoRA(qkv, targets, rank, slots, magnitudes)
        block.attn.qkv = wrapper
        wrappers.append(wrapper)
    return LoRA(wrappers, magnitudes)
