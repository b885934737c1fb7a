"""CODA-Prompt (Smith et al., "CODA-Prompt: COntinual Decomposed Attention-based Prompting for Rehearsal-Free
Continual Learning", CVPR 2023), as its official code runs it (GT-RIPL/CODA-Prompt @ 6417d4f: models/zoo.py
CodaPrompt, models/vit.py, learners/prompt.py).

Every block of ``layers`` ([0..4]) has a pool of ``pool_size`` (100) prompt components P_m (``length`` 8 x width),
keys K_m and attention vectors A_m (width each). With T tasks, task t owns components [t M/T, (t+1) M/T). For a sample
with query q (the frozen unprompted ViT's pre-logit feature), each component available (those of tasks 0..t) weighs
alpha_m = cos(q ⊙ A_m, K_m) (no softmax, no top-k), and the block's prompt is sum_m alpha_m P_m: its first length/2
rows are prepended to the attention's keys, the rest to its values (prefix tuning, :class:`PrefixAttention`).

While task t trains only its own components learn: earlier ones enter detached (frozen), later ones are not used. At
the start of each task its components are initialised (``init=gram_schmidt``, the official code since June 2023):
fresh N(0, 1) vectors made orthogonal to every earlier component by classical Gram-Schmidt (each projected on the
earlier components one by one, as the code) and normalised; later components are zero. ``init=orthogonal`` is the
paper-era code: the whole pool orthonormal once, at the start. The orthogonality loss, ``ortho_mu`` x mean((T T^T -
I)^2) for T = K, A and P flattened over the components in use, summed over the blocks, is the paper's; the official
scripts set ``ortho_mu`` to 0 (the init gives the orthogonality), as here.

Loss: cross-entropy over the current task's classes (past classes' logits at -inf, future ones not in the head) +
the orthogonality loss. Trainable: the pools and the current task's head; nothing moves the frozen components (a
fresh optimizer each task and no weight decay, as the official code: bit-identical).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.base import HEAD_INITS, Logs
from clbench.methods.prompting import PromptMethod, log, within_depth, wrap_prefix_layers


@dataclass
class CODAPromptConfig:
    pool_size: int = 100  # components per block, shared out over the tasks (official 100)
    length: int = 8  # rows of a component: length/2 key and length/2 value vectors (official 8)
    layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])  # prompted blocks (official 0..4)
    ortho_mu: float = 0.0  # weight of the orthogonality loss (official scripts: 0; paper era: 0.1 x 1e-6)
    init: str = "gram_schmidt"  # gram_schmidt: each task's components when it starts (official) | orthogonal
    head_init: str = "default"  # default: nn.Linear's | trunc_normal: N(0, 0.02) (PyTorch ports) | zeros (JAX code)

    def __post_init__(self) -> None:
        require(self.pool_size >= 1, "method.pool_size", self.pool_size, "an integer >= 1")
        require(self.length >= 2 and self.length % 2 == 0, "method.length", self.length, "an even integer >= 2")
        ok = len(self.layers) > 0 and all(isinstance(i, int) and i >= 0 for i in self.layers)
        require(ok, "method.layers", self.layers, "a non-empty list of block indices")
        require(self.ortho_mu >= 0, "method.ortho_mu", self.ortho_mu, "a float >= 0")
        require_choice("method.init", self.init, ("gram_schmidt", "orthogonal"))
        require_choice("method.head_init", self.head_init, HEAD_INITS)


def gram_schmidt(rows: torch.Tensor, start: int, end: int, fresh: torch.Tensor) -> torch.Tensor:
    """The official init of a task's components: rows [0, start) kept, row k in [start, end) = fresh[k - start] minus
    its projections on every earlier row (classical Gram-Schmidt, one earlier row at a time), then normalised; rows
    from ``end`` on zero. ``rows``: (M, ...) flattened per row; ``fresh``: (end - start, row size) N(0, 1) draws."""
    flat = rows.reshape(len(rows), -1)
    out = torch.zeros_like(flat)
    out[:start] = flat[:start]
    for k in range(start, end):
        v = fresh[k - start]
        earlier = out[:k]
        norms = (earlier * earlier).sum(1)
        if bool((norms < 1e-8).any()):
            raise RuntimeError("Gram-Schmidt met a zero component")
        out[k] = v - ((earlier @ v) / norms) @ earlier
    out[start:end] = out[start:end] / out[start:end].norm(dim=1, keepdim=True)
    return out.view_as(rows)


def ortho_penalty(t: torch.Tensor) -> torch.Tensor:
    """mean((T T^T - I)^2) over a matrix of row vectors (the official ortho_penalty)."""
    return ((t @ t.T - torch.eye(len(t), device=t.device, dtype=t.dtype)) ** 2).mean()


class CODAPrompt(PromptMethod):
    Config = CODAPromptConfig

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: CODAPromptConfig) -> None:
        super().__init__(backbone, benchmark, config, None)
        tasks, width = len(benchmark.tasks), backbone.embed_dim
        # Keys and attention vectors are width-long: at most `width` of them can be orthogonal.
        usable = min(config.pool_size, width) if config.init == "gram_schmidt" else config.pool_size
        if usable < tasks:
            raise ConfigError(
                f"Invalid value for `method.pool_size`: {config.pool_size}. Allowed: at least one component per task "
                f"(>= {tasks}, and with init=gram_schmidt at most the backbone's width {width} in all)."
            )
        if usable < config.pool_size:
            log.warning(
                "method.pool_size=%d: the backbone's width %d holds at most %d orthogonal keys; using %d components",
                config.pool_size,
                width,
                width,
                usable // tasks * tasks,
            )
        self.per_task = usable // tasks
        self.layers = within_depth("method.layers", config.layers, len(backbone.blocks))
        self.prefixed = wrap_prefix_layers(backbone, self.layers)
        m, device = self.per_task * tasks, backbone.pos_embed.device

        def pool(*shape: int) -> nn.ParameterList:
            return nn.ParameterList(nn.Parameter(torch.zeros(*shape, device=device)) for _ in self.layers)

        self.components, self.keys, self.attention = pool(m, config.length, width), pool(m, width), pool(m, width)
        if config.init == "orthogonal":
            with torch.no_grad():
                for p in self.pools():
                    nn.init.orthogonal_(p.view(len(p), -1))

    def pools(self) -> list[nn.Parameter]:
        return [*self.components, *self.keys, *self.attention]

    def prompt_parameters(self) -> dict[str, nn.Parameter]:
        pools = {"components": self.components, "keys": self.keys, "attention": self.attention}
        return {f"{name}.{layer}": p for name, ps in pools.items() for layer, p in zip(self.layers, ps, strict=True)}

    # ----------------------------------------------------------------------------- prompts
    def span(self, task_id: int) -> tuple[int, int]:
        """Task ``task_id``'s components [start, end)."""
        return task_id * self.per_task, (task_id + 1) * self.per_task

    def block_prompt(self, i: int, q: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``self.layers[i]``'s prefix for the batch (B, 2, length/2, width) and its orthogonality loss: the
        components in use weighted by cos(q ⊙ A_m, K_m); in training the earlier tasks' enter detached."""
        start, end = self.span(self.num_seen - 1)
        pools = (self.components[i], self.keys[i], self.attention[i])
        components, keys, attention = (
            torch.cat([p[:start].detach(), p[start:end]]) if training else p[:end] for p in pools
        )
        weighted = F.normalize(q[:, None, :] * attention, dim=2)  # (B, f, width)
        alpha = torch.einsum("bkd,kd->bk", weighted, F.normalize(keys, dim=1))
        prompt = torch.einsum("bk,kld->bld", alpha, components)  # (B, length, width)
        loss = q.new_zeros(())
        if training and self.config.ortho_mu > 0:
            loss = self.config.ortho_mu * sum(ortho_penalty(t.flatten(1)) for t in (keys, attention, components))
        return prompt.unflatten(1, (2, -1)), loss

    def prompted(self, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled feature of the prompted pass, and the orthogonality loss summed over the blocks."""
        q = self.query(x)
        loss = q.new_zeros(())
        for i, attn in enumerate(self.prefixed.values()):
            attn.prefix, block_loss = self.block_prompt(i, q, training)
            loss = loss + block_loss
        try:
            return self.pooled(x), loss
        finally:
            for attn in self.prefixed.values():
                attn.prefix = None

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """Every seen task's components, weighted per sample by the query: no task id is used."""
        return self.prompted(x, training=False)[0]

    # ----------------------------------------------------------------------------- training
    @torch.no_grad()
    def before_task(self, task: Task) -> None:
        super().before_task(task)
        if self.config.init != "gram_schmidt":
            return
        start, end = self.span(task.id)
        for p in self.pools():
            fresh = torch.randn(end - start, p[0].numel(), device=p.device)
            p.copy_(gram_schmidt(p, start, end, fresh))

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        feats, ortho = self.prompted(x, training=True)
        ce = self.current_task_ce(self.seen_logits(feats), y, task)
        return ce + ortho, {"ortho": ortho.detach()}

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: its head and its components, keys and attention vectors in every prompted block (32-bit)."""
        out = super().storage()
        per_component = sum(p[0].numel() for p in self.pools())
        for entry in out["bits_per_task"]:
            entry["components"] = 32 * per_component * self.per_task
        del out["shared_bits"]
        return out
