"""DualPrompt (Wang et al., "DualPrompt: Complementary Prompting for Rehearsal-free Continual Learning", ECCV 2022),
as its official code runs it (google-research/l2p @ dd8836e, configs/{cifar100,imr}_dualprompt.py; and its PyTorch port
JH-LEE-KR/dualprompt-pytorch @ 7eb457d).

Over a frozen pretrained ViT, two kinds of prompts:
- a G-prompt (general), shared by all tasks, in blocks ``g_layers`` ([0, 1]), ``g_length`` (5) long;
- an E-prompt pool (expert) of ``pool_size`` prompts (null: one per task, as the official 10 for 10 tasks), each
  ``e_length`` long (5 for Split CIFAR-100, 20 for ImageNet-R) in every block of ``e_layers`` ([2, 3, 4]), with one key
  per prompt shared by those blocks.
Prompts attach by prefix tuning (the official default): a prompt of length L holds L key and L value vectors,
prepended to the keys and values of the block's attention after their projection (:class:`PrefixAttention`); a block
in both lists gets [G, E] (the JAX code). ``prefix=false`` prepends them to the token sequence instead (prompt
tuning; the inserted tokens stay until the end and are dropped before the pooling).

Selection: the query q(x) is the frozen unprompted ViT's pre-logit feature; at test the ``top_k`` (1) E-prompts whose
keys are most cosine-similar to q, per sample (``batchwise_prompt=true``: the official CIFAR config's majority vote
over the batch, off by default because a prediction then depends on its batch). While task t trains, every sample
uses E-prompt slot t (the official ``use_prompt_mask``). At the start of task t > 0, slot t starts from slot t - 1's
prompt (``shared_prompt_pool``); keys are not copied (``shared_prompt_key=False``).

Loss: cross-entropy over the current task's classes (``train_mask``) + ``pull`` (1.0) x mean over the batch of
(1 - cos(q, k_t)): the official CE - 1.0 x mean cos, the same gradient. The keys learn only through this term. The
classifier reads the prompted pass's pooled feature (the final-norm CLS token for a CLS-pooled ViT, as the code).
Trainable: G-prompt, E-prompts, keys and the current task's head; old slots get no gradient (a fresh optimizer each
task, no weight decay: they stay bit-identical).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.base import HEAD_INITS
from clbench.methods.prompting import (
    PromptMethod,
    cosine,
    prompt_init,
    top_k_by_key,
    within_depth,
    wrap_prefix_layers,
)


@dataclass
class DualPromptConfig:
    g_length: int = 5  # G-prompt length (official: g_prompt_length 5)
    g_layers: list[int] = field(default_factory=lambda: [0, 1])  # official g_prompt_layer_idx
    e_length: int = 5  # E-prompt length (official: 5 for Split CIFAR-100, 20 for ImageNet-R)
    e_layers: list[int] = field(default_factory=lambda: [2, 3, 4])  # official e_prompt_layer_idx
    pool_size: int | None = None  # E-prompts; null: tasks x top_k (official 10 for 10 tasks)
    top_k: int = 1  # E-prompts per sample (official 1)
    pull: float = 1.0  # weight of the key-pull term (official pull_constraint_coeff 1.0)
    prefix: bool = True  # prefix tuning (official) | false: prompt tuning (tokens prepended)
    shared_prompt_pool: bool = True  # task t's E-prompt starts from task t-1's (official)
    batchwise_prompt: bool = False  # the official CIFAR config's per-batch vote at test (a protocol leak; off)
    prompt_init: str = "uniform"  # uniform: U(-1, 1) (PyTorch port) | small: U(0, 0.01) (JAX code)
    head_init: str = "default"  # default: nn.Linear's | trunc_normal: N(0, 0.02) (PyTorch ports) | zeros (JAX code)

    def __post_init__(self) -> None:
        for key in ("g_length", "e_length", "top_k"):
            require(getattr(self, key) >= 1, f"method.{key}", getattr(self, key), "an integer >= 1")
        for key in ("g_layers", "e_layers"):
            layers = getattr(self, key)
            ok = all(isinstance(i, int) and i >= 0 for i in layers) and (key == "g_layers" or len(layers) > 0)
            require(ok, f"method.{key}", layers, "a list of block indices (e_layers: not empty)")
        require(self.pool_size is None or self.pool_size >= 1, "method.pool_size", self.pool_size, "null or >= 1")
        require(self.pull >= 0, "method.pull", self.pull, "a float >= 0")
        require_choice("method.prompt_init", self.prompt_init, ("uniform", "small"))
        require_choice("method.head_init", self.head_init, HEAD_INITS)


class DualPrompt(PromptMethod):
    Config = DualPromptConfig
    batch_level_options = ("batchwise_prompt",)

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: DualPromptConfig) -> None:
        tasks = len(benchmark.tasks)
        pool = config.pool_size or tasks * config.top_k
        if pool < tasks * config.top_k:
            raise ConfigError(
                f"Invalid value for `method.pool_size`: {pool}. Allowed: >= tasks x top_k = {tasks * config.top_k} "
                "(task t trains E-prompts t*top_k .. t*top_k + top_k - 1)."
            )
        super().__init__(backbone, benchmark, config, pool)
        depth, width = len(backbone.blocks), backbone.embed_dim
        self.g_layers = within_depth("method.g_layers", config.g_layers, depth) if config.g_layers else []
        self.e_layers = within_depth("method.e_layers", config.e_layers, depth)
        sides = 2 if config.prefix else 1  # prefix: a key and a value vector per position
        device = backbone.pos_embed.device

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(prompt_init(config.prompt_init, *shape, device=device))

        self.g_prompt = param(len(self.g_layers), sides, config.g_length, width)
        self.e_prompt = param(len(self.e_layers), pool, sides, config.e_length, width)
        self.keys = param(pool, width)
        layers = sorted({*self.g_layers, *self.e_layers})
        self.prefixed = wrap_prefix_layers(backbone, layers) if config.prefix else {}

    def prompt_parameters(self) -> dict[str, nn.Parameter]:
        return {"g_prompt": self.g_prompt, "e_prompt": self.e_prompt, "keys": self.keys}

    # ----------------------------------------------------------------------------- prompts
    def slots(self, task_id: int) -> torch.Tensor:
        """Task ``task_id``'s E-prompts: the ones it trains (``use_prompt_mask``)."""
        k = self.config.top_k
        return torch.arange(task_id * k, (task_id + 1) * k, device=self.keys.device)

    def layer_prompts(self, chosen: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each prompted block's prompt for the batch: (B, sides, length, width), [G, E] where a block has both."""
        b = len(chosen)
        prompts: dict[int, list[torch.Tensor]] = {}
        for i, layer in enumerate(self.g_layers):
            prompts.setdefault(layer, []).append(self.g_prompt[i].expand(b, -1, -1, -1))
        for i, layer in enumerate(self.e_layers):
            e = self.e_prompt[i][chosen]  # (B, k, sides, Le, D)
            prompts.setdefault(layer, []).append(e.transpose(1, 2).flatten(2, 3))  # (B, sides, k * Le, D)
        return {layer: torch.cat(parts, dim=2) for layer, parts in prompts.items()}

    def prompted_features(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The pooled feature of the pass with the chosen E-prompts (and the G-prompt)."""
        prompts = self.layer_prompts(chosen)
        if not self.config.prefix:
            return self.prompt_tuned_features(x, {k: v[:, 0] for k, v in prompts.items()})
        for layer, attn in self.prefixed.items():
            attn.prefix = prompts[layer]
        try:
            return self.pooled(x)
        finally:
            for attn in self.prefixed.values():
                attn.prefix = None

    def prompt_tuned_features(self, x: torch.Tensor, tokens: dict[int, torch.Tensor]) -> torch.Tensor:
        """Prompt tuning: each block's prompt tokens inserted after the prefix tokens (CLS) before the block; every
        inserted token stays to the end and is dropped before the final norm's pooling."""
        vit = self.backbone
        h = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
        prefix, inserted = vit.num_prefix_tokens, 0
        for i, block in enumerate(vit.blocks):
            if i in tokens:
                h = torch.cat([h[:, :prefix], tokens[i].to(h.dtype), h[:, prefix:]], dim=1)
                inserted += tokens[i].shape[1]
            h = block(h)
        h = torch.cat([h[:, :prefix], h[:, prefix + inserted :]], dim=1)
        return vit.forward_head(vit.norm(h), pre_logits=True)

    def select(self, q: torch.Tensor, task: Task | None) -> torch.Tensor:
        """Training task t: E-prompt slots t (``use_prompt_mask``); at test the top-k by key."""
        if task is not None:
            return self.slots(task.id).expand(len(q), -1)
        return top_k_by_key(cosine(q, self.keys), self.config.top_k, self.config.batchwise_prompt)

    # ----------------------------------------------------------------------------- training
    @torch.no_grad()
    def before_task(self, task: Task) -> None:
        super().before_task(task)
        if self.config.shared_prompt_pool and task.id > 0:
            self.e_prompt[:, self.slots(task.id)] = self.e_prompt[:, self.slots(task.id - 1)]

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: its head, its E-prompts and their keys (32-bit); shared: the G-prompt."""
        out = super().storage()
        per_slot = self.e_prompt[:, 0].numel() + self.keys.shape[1]
        for entry in out["bits_per_task"]:
            entry["e_prompts"] = 32 * per_slot * self.config.top_k
        out["shared_bits"] = {"g_prompt": 32 * self.g_prompt.numel()}
        return out
