"""MEAT (Xue, Zhang, Song & Song, CVPR 2022): meta-attention masks over a frozen pretrained ViT.

Per task, two kinds of binary masks are learned over the frozen backbone (the pretrained weights never change):
- token masks (attention to self-attention, Eqs. 4-5): a keep-mask over the patch tokens of each layer in
  ``token_mask_layers`` (null: every layer, as the paper says; ``[3, 6, 9]`` is the official code's
  choice), shared by all heads, CLS always kept; masked tokens are removed as keys
  (:mod:`clbench.methods.token_masking`);
- FFN masks (attention to FFN neurons, Eq. 8): element-wise masks on the weights of ``mlp.fc1`` and
  ``mlp.fc2`` (biases unmasked), through the shared masked-Linear mechanism.

Every mask entry has two logits t (keep, drop). Training samples m = hard Gumbel-softmax(t, ``tau``)[keep]
with a straight-through gradient (Eq. 6), token masks once per image and FFN masks once per forward pass (as the
official code); evaluation and the stored mask use the argmax, without noise
(Eq. 7). ``init=uniform`` draws both logits from U(-gamma, gamma) (the paper); ``init=keep`` sets
(gamma, -gamma), so every mask starts as "keep" (the official code).

Loss (Eqs. 9-10): CE + ``alpha`` * mean over the token-masked layers of (``lam`` - mean_i m_i)^2; FFN masks are not
in the drop-control term. Two lock-step differences from the official code are options: its drop-control term sums
over the layers (``drop_control=sum``: alpha in effect L times larger), and its attention keeps a masked token
attending to itself (``token_attention=code``); clbench follows the paper's Eq. 5 and 10 by default. Learning rates
(paper): head 5e-4 and masks 0.1, both times batch / 1024. Each task has its own head; the task id selects masks and
head (TIL); CIL infers the task by lowest entropy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.backbones.refiner import RefinerAttention
from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.base import Logs
from clbench.methods.masked_method import ScoredMaskMethod
from clbench.methods.masking import MaskedLayer, pack_bits, unpack_bits
from clbench.methods.token_masking import KeyMaskedAttention


@dataclass
class MEATConfig:
    gamma: float = 4.0  # init range of the mask logits (paper: 4)
    alpha: float = 2.0  # weight of the drop-control loss (paper: 2)
    lam: float = 0.9  # target keep ratio of the token masks (paper: 0.9)
    tau: float = 1.0  # Gumbel-softmax temperature (paper: not given; official code: 1)
    init: str = "keep"  # keep: (gamma, -gamma) (official code) | uniform: U(-gamma, gamma) (paper)
    token_mask_layers: list[int] | None = None  # blocks with token masks; null: all (paper); [3, 6, 9]: code
    mask_lr: float | None = 0.1  # learning rate of all mask logits (paper: 0.1 x batch / 1024)
    layers: list[str] = field(default_factory=lambda: ["mlp.fc1", "mlp.fc2"])  # FFN-masked Linears
    # paper: a masked token is no key for any query (Eq. 5) | code: it still attends to itself (the official
    # softmax_with_policy, DynamicViT's: eps 1e-6, an explicit attention map, unfused)
    token_attention: str = "paper"
    drop_control: str = "mean"  # mean over the token-masked layers (paper Eq. 10) | sum (the official MaskKeepLoss)

    def __post_init__(self) -> None:
        require(self.gamma > 0, "method.gamma", self.gamma, "a float > 0")
        require(self.alpha >= 0, "method.alpha", self.alpha, "a float >= 0")
        require(0 <= self.lam <= 1, "method.lam", self.lam, "a float in [0, 1]")
        require(self.tau > 0, "method.tau", self.tau, "a float > 0")
        require_choice("method.init", self.init, ("uniform", "keep"))
        layers = self.token_mask_layers
        ok = layers is None or (len(layers) > 0 and all(isinstance(i, int) and i >= 0 for i in layers))
        require(ok, "method.token_mask_layers", layers, "null (all blocks) or a non-empty list of block indices")
        require(self.mask_lr is None or self.mask_lr > 0, "method.mask_lr", self.mask_lr, "null or a float > 0")
        require_choice("method.token_attention", self.token_attention, ("paper", "code"))
        require_choice("method.drop_control", self.drop_control, ("mean", "sum"))


def hard_gumbel_keep(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """``F.gumbel_softmax(logits, tau, hard=True)[..., 0]`` for two categories, in half the work: the difference
    of two Gumbel(0, 1) draws is one Logistic(0, 1) draw, and a two-way softmax is the sigmoid of the logit
    difference. Same distribution, same straight-through gradient; no one-hot scatter."""
    u = torch.rand_like(logits[..., 0])
    soft = torch.sigmoid((logits[..., 0] - logits[..., 1] + torch.log(u) - torch.log1p(-u)) / tau)
    hard = (soft > 0.5).to(soft.dtype)
    return hard - soft.detach() + soft  # exactly 0 or 1 forward (1 - s is exact for s >= 0.5)


def drop_control_loss(keep: list[torch.Tensor], lam: float, reduction: str = "mean") -> torch.Tensor:
    """Eq. 10: mean over layers of (lam - fraction of kept tokens)^2 (``reduction="sum"``: the official code's sum,
    which weighs the term by the number of token-masked layers)."""
    terms = torch.stack([(lam - m.float().mean()) ** 2 for m in keep])
    return terms.sum() if reduction == "sum" else terms.mean()


class MEAT(ScoredMaskMethod):
    Config = MEATConfig

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: MEATConfig) -> None:
        super().__init__(backbone, benchmark, config)
        depth = len(backbone.blocks)
        chosen = list(range(depth)) if config.token_mask_layers is None else sorted(set(config.token_mask_layers))
        if chosen[-1] >= depth:
            raise ConfigError(
                f"Invalid value for `method.token_mask_layers`: {config.token_mask_layers}. "
                f"Allowed: block indices 0..{depth - 1} of {type(backbone).__name__} (depth {depth})."
            )
        self.num_tokens = backbone.patch_embed.num_patches
        self.attentions: dict[int, KeyMaskedAttention] = {}
        if config.token_attention == "code" and any(isinstance(b.attn, RefinerAttention) for b in backbone.blocks):
            raise ConfigError(
                "Invalid value for `method.token_attention`: code. Allowed: paper with Refiner attention (it masks its "
                "own attention maps the paper's way)."
            )
        for i in chosen:
            block = backbone.blocks[i]
            self_kept = config.token_attention == "code"
            block.attn = self.attentions[i] = KeyMaskedAttention(block.attn, backbone.num_prefix_tokens, self_kept)

    @staticmethod
    def unused_keys(config: MEATConfig) -> dict[str, str]:
        """lam is only the drop-control term's target (Eq. 10), which alpha=0 switches off."""
        return {"method.lam": "method.alpha=0 (no drop-control term)"} if config.alpha == 0 else {}

    # ----------------------------------------------------------------------------- mask logits
    def init_logits(self, *shape: int) -> torch.Tensor:
        device = self.backbone.cls_token.device
        gamma = self.config.gamma
        if self.config.init == "keep":
            return torch.tensor([gamma, -gamma], device=device).expand(*shape, 2).clone()
        return torch.empty(*shape, 2, device=device).uniform_(-gamma, gamma)

    def init_scores(self, layer: MaskedLayer) -> torch.Tensor:
        return self.init_logits(*layer.weight.shape)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Training: a hard Gumbel-softmax sample of "keep" (straight-through); evaluation: the argmax."""
        if self.training:
            return hard_gumbel_keep(logits, self.config.tau)
        return self.keep_argmax(logits).to(logits.dtype)

    @staticmethod
    def keep_argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits[..., 0] > logits[..., 1]

    def binarize(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        return self.sample(scores)

    def final_mask(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        return self.keep_argmax(scores)

    # ----------------------------------------------------------------------------- token masks
    def token_mask(self, layer: int, task_id: int, batch: int | None = None) -> torch.Tensor | None:
        """The stored mask (N,) of a finished task; for the task in training, one sample (N,), or with ``batch``
        one sample per image (B, N): the official code's per-sample Gumbel noise (one draw for the whole batch
        would multiply the variance of the mask gradient by the batch size)."""
        stored = getattr(self, f"token_{task_id}_{layer}", None)
        if stored is not None:
            return stored
        if task_id == self.num_seen - 1 and f"token_{layer}" in self.scores:
            logits = self.scores[f"token_{layer}"]
            return self.sample(logits if batch is None else logits.expand(batch, *logits.shape))
        return None

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is None:
            raise ValueError("MEAT needs a task id to pick its masks")
        return self._features_with(x, task_id, {i: self.token_mask(i, task_id) for i in self.attentions})

    def _features_with(self, x: torch.Tensor, task_id: int, keep: dict[int, torch.Tensor | None]) -> torch.Tensor:
        for i, attn in self.attentions.items():
            attn.keep = keep[i]
        try:
            return super().features(x, task_id)  # sets the FFN masks
        finally:
            for attn in self.attentions.values():
                attn.keep = None

    # ----------------------------------------------------------------------------- training
    def before_task(self, task: Task) -> None:
        super().before_task(task)
        for i in self.attentions:
            self.scores[f"token_{i}"] = nn.Parameter(self.init_logits(self.num_tokens))

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """CE + alpha * L_dc (Eqs. 9-10), with one Gumbel sample per image and token-masked layer, shared by the
        forward pass and L_dc (whose kept fraction is the mean over images and tokens, as the official code's).
        The samples are drawn for the whole batch and this rank takes its rows (``batch_share``)."""
        size, part = self.batch_share or (len(x), slice(None))
        masks = {i: self.token_mask(i, task.id, size) for i in self.attentions}  # (size, N): the whole batch's draws
        logits = self.heads[task.id](self._features_with(x, task.id, {i: m[part] for i, m in masks.items()}))
        ce = self.task_loss(logits, y, task)
        if not masks:
            return ce, {}
        # L_dc over the whole batch's masks: the same term on every rank of a multi-process run, so the averaged
        # gradient equals one process's exactly (a mean over a rank's share would not, L_dc being a square).
        dc = drop_control_loss(list(masks.values()), self.config.lam, self.config.drop_control)
        kept = torch.stack([m.detach().float().mean() for m in masks.values()]).mean()
        return ce + self.config.alpha * dc, {"drop_control": dc.detach(), "token_keep_ratio": kept}

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        for i in self.attentions:
            self.register_buffer(f"token_{task.id}_{i}", self.keep_argmax(self.scores.pop(f"token_{i}")))
        super().after_task(task)

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: the head, FFN masks (1 bit per fc1/fc2 weight) and token masks (1 bit per patch token per
        token-masked layer)."""
        out = super().storage()
        for entry in out["bits_per_task"]:
            if "masks" in entry:
                entry["ffn_masks"] = entry.pop("masks")
                entry["token_masks"] = self.num_tokens * len(self.attentions)
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        out = super().artifacts()
        for t in range(self.num_seen):
            for i in self.attentions:
                stored = getattr(self, f"token_{t}_{i}", None)
                if stored is not None:
                    out[f"token.{t}.{i}"] = pack_bits(stored)
        return out

    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for t in range(self.num_seen):
            for i in self.attentions:
                packed = tensors[f"token.{t}.{i}"].to(self.backbone.cls_token.device)
                self.register_buffer(f"token_{t}_{i}", unpack_bits(packed, (self.num_tokens,)))
