"""L2P (Wang et al., "Learning to Prompt for Continual Learning", CVPR 2022): a prompt pool over a frozen ViT.

A pool of M prompts P_j (Lp tokens of width D each) with learnable keys k_j. The query q(x) is the frozen,
unprompted ViT's pooled pre-logit feature (final-norm CLS token for a CLS-pooled ViT), computed without
gradients with the same weights; the N prompts whose keys are most cosine-similar to q(x) are
prepended to the patch tokens (Eq. 2-3), and the head reads the mean of the outputs at the prompt
positions. Loss (Eq. 5): CE over the current task's classes (other logits masked to -inf) + ``pull`` *
sum over the selected keys of (1 - cos(q, k)) / batch. The backbone never changes; prompts, keys and the
head are trained with a fresh optimizer per task. No task id at test: one head over all seen classes (the
per-task heads concatenated); TIL reads the task's own logits.

Options where the paper and its two official codes differ:
- ``layout=paper`` (paper-era JAX and PyTorch codes): [CLS; prompts; patches], every prompt token gets a
  copy of CLS's position embedding; ``layout=dualprompt`` (later JAX): [prompts; CLS; patches], prompts
  without position embedding.
- ``diversify=none`` (paper for CIFAR-100); ``frequency`` (paper Eq. 4, training only): the top-N keys by
  (1 - cos(q, k)) * h, h the normalised selection counts of the previous tasks; ``task_slots`` (the codes'
  prompt mask): task t trains prompts t*N .. t*N+N-1, initialised from the previous task's slot
  (``shared_prompt_pool``); its keys are not copied (``shared_prompt_key=false``, the official configs; true copies
  them too, clbench's behaviour before).
- ``batchwise_prompt=true`` (both codes): every sample of a batch uses the batch's N most-selected prompts (ties
  to the smaller prompt index, as the JAX code's sorted unique + top_k; the PyTorch code's torch.topk leaves ties
  unordered), at train and test, so a prediction depends on its batch. Off by default; recorded in results.json.

L2P-R (a rehearsal memory, ``memory.per_class``; google-research/l2p@dd8836e train_continual.py L696-760 and
libml/continual_buffer.py): the memory's ``uniform`` sampler keeps a uniform subset of each task's first epoch, stored
as the step meets it and before it draws; each step joins as many replayed rows as its batch, whose cross-entropy is
unmasked, and trains every head its loss reaches. ``replay_scope=seen`` (default): the replayed rows over the seen
classes; ``all``: over every class of the benchmark, the code's one head over all classes with ``replay_no_mask``
(every task's head exists from the start, the future classes' columns pushed down by the replayed rows, and read by
``trainer.cil_classes=all``). ``replay_first_task=true`` (default) replays as soon as the memory holds an image;
false only from the second task on (the code's ``task_id > 0``), the first only filling it. ``memory.view=augmented``
replays the view each image was stored in (the code's buffer holds the preprocessed batch) instead of augmenting the
stored image again at every draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.base import HEAD_INITS
from clbench.methods.prompting import PromptMethod, cosine, prompt_init, top_k_by_key


@dataclass
class L2PConfig:
    pool_size: int = 10  # M
    top_n: int = 5  # N prompts per sample
    prompt_length: int = 5  # Lp tokens per prompt
    pull: float = 0.5  # lambda of the surrogate key-pull loss (paper: 0.5; codes: 0.1-1.0)
    layout: str = (
        "paper"  # paper: [CLS; prompts; patches], CLS pos-emb on prompts | dualprompt: [prompts; CLS; patches]
    )
    diversify: str = "none"  # none | frequency (paper Eq. 4) | task_slots (the codes' prompt mask)
    shared_prompt_pool: bool = True  # task_slots only: a task's slot starts from the previous task's prompts
    shared_prompt_key: bool = False  # task_slots only: ... and keys (official: false, shared_prompt_key=False)
    batchwise_prompt: bool = False  # the codes' per-batch majority vote (predictions depend on the batch)
    prompt_init: str = "uniform"  # uniform: U(-1, 1) (PyTorch code) | small: U(0, 0.01) (JAX code)
    head_init: str = "default"  # default: nn.Linear's | trunc_normal: N(0, 0.02) (PyTorch ports) | zeros (JAX code)
    replay_scope: str = "seen"  # L2P-R's replayed rows: CE over the seen classes | all: every class (replay_no_mask)
    replay_first_task: bool = True  # L2P-R replays from the first task | false: from the second (the code's)

    def __post_init__(self) -> None:
        require(self.pool_size >= 1, "method.pool_size", self.pool_size, "an integer >= 1")
        require(1 <= self.top_n <= self.pool_size, "method.top_n", self.top_n, "an integer in [1, pool_size]")
        require(self.prompt_length >= 1, "method.prompt_length", self.prompt_length, "an integer >= 1")
        require(self.pull >= 0, "method.pull", self.pull, "a float >= 0")
        require_choice("method.layout", self.layout, ("paper", "dualprompt"))
        require_choice("method.diversify", self.diversify, ("none", "frequency", "task_slots"))
        require_choice("method.prompt_init", self.prompt_init, ("uniform", "small"))
        require_choice("method.head_init", self.head_init, HEAD_INITS)
        require_choice("method.replay_scope", self.replay_scope, ("seen", "all"))


class L2P(PromptMethod):
    Config = L2PConfig
    batch_level_options = ("batchwise_prompt",)
    # L2P-R (Table 1): the official code's memory (a uniform subset of each task's first epoch, replayed from the
    # moment it is stored), one memory batch of the batch's size joined to each step.
    memory_sampler: ClassVar[str | None] = "uniform"
    replay_draws: ClassVar[int] = 1

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: L2PConfig) -> None:
        super().__init__(backbone, benchmark, config, config.pool_size)
        if backbone.cls_token is None or backbone.num_prefix_tokens != 1 or getattr(backbone, "no_embed_class", False):
            raise ConfigError("L2P needs a ViT with one class token and a position embedding for it (timm's default).")
        if config.diversify == "task_slots" and config.pool_size < len(benchmark.tasks) * config.top_n:
            raise ConfigError(
                f"Invalid value for `method.pool_size`: {config.pool_size}. Allowed with diversify=task_slots: "
                f">= tasks x top_n = {len(benchmark.tasks) * config.top_n}."
            )
        m, length, dim = config.pool_size, config.prompt_length, backbone.embed_dim
        self.prompts = nn.Parameter(prompt_init(config.prompt_init, m, length, dim, device=backbone.cls_token.device))
        self.keys = nn.Parameter(prompt_init(config.prompt_init, m, dim, device=backbone.cls_token.device))
        # replay_scope=all: the one head over every class of the benchmark, a head a task from the start; a task's
        # joins ``heads`` when the task begins (the same module: its weights are the ones trained so far)
        self.whole: nn.ModuleList | None = None
        if config.replay_scope == "all":
            self.whole = nn.ModuleList(self.new_head(task.num_classes) for task in benchmark.tasks)

    def prompt_parameters(self) -> dict[str, nn.Parameter]:
        return {"prompts": self.prompts, "keys": self.keys}

    # ----------------------------------------------------------------------------- L2P-R's heads
    def add_head(self, num_classes: int) -> nn.Linear:
        """The next task's head: with ``replay_scope=all`` the one that exists from the start."""
        if self.whole is None:
            return super().add_head(num_classes)
        head = self.whole[self.num_seen]
        self.heads.append(head)
        return head

    def untrained_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """With ``replay_scope=all`` the future tasks' heads as the replayed rows left them (the code's columns)."""
        if self.whole is None:
            return super().untrained_logits(feats)
        return torch.cat([feats.new_zeros(len(feats), 0), *(h(feats) for h in self.whole[self.num_seen :])], dim=1)

    def training_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Every seen class's logits; with a memory and ``replay_scope=all`` every class's."""
        logits = self.seen_logits(feats)
        if self.memory is None or self.whole is None:
            return logits
        return torch.cat([logits, self.untrained_logits(feats).to(logits.dtype)], dim=1)

    def trained_heads(self, task: Task) -> list[nn.Linear]:
        """With a memory, every head the replayed rows reach (seen, or with ``replay_scope=all`` every one); without,
        the task's own."""
        if self.memory is None:
            return super().trained_heads(task)
        return list(self.whole) if self.whole is not None else list(self.heads)

    def draws_replay(self, task: Task) -> bool:
        return self.config.replay_first_task or task.id > 0

    def artifacts(self) -> dict[str, torch.Tensor]:
        """With ``replay_scope=all``, also the future tasks' heads (the CIL over every class reads them)."""
        out = super().artifacts()
        for t in range(self.num_seen, len(self.whole) if self.whole is not None else 0):
            out |= {f"whole.{t}.{k}": v.detach().clone() for k, v in self.whole[t].state_dict().items()}
        return out

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for t in range(self.num_seen, len(self.whole) if self.whole is not None else 0):
            self.whole[t].load_state_dict({k.removeprefix(f"whole.{t}."): v for k, v in tensors.items() if
                                           k.startswith(f"whole.{t}.")})  # fmt: skip

    # ----------------------------------------------------------------------------- selection
    def select(self, q: torch.Tensor, task: Task | None) -> torch.Tensor:
        """Indices (B, N) of the prompts each sample uses; ``task`` is set while training it."""
        cfg = self.config
        n = cfg.top_n
        if task is not None and cfg.diversify == "task_slots":
            slot = torch.arange(task.id * n, (task.id + 1) * n, device=q.device)
            return slot.expand(len(q), n)
        sim = cosine(q, self.keys)
        if task is not None and cfg.diversify == "frequency" and task.id > 0:
            counts = self.train_counts[: task.id].sum(0).float()
            sim = -((1 - sim) * counts / counts.sum())  # the smallest frequency-weighted distances first
        return top_k_by_key(sim, n, cfg.batchwise_prompt)

    # ----------------------------------------------------------------------------- prompted forward
    def prompted_features(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Mean of the final-norm outputs at the prompt positions (Sec. 4.2, f_r^avg)."""
        vit = self.backbone
        patches = vit.patch_embed(x)
        b = patches.shape[0]
        prompts = self.prompts[chosen].flatten(1, 2).to(patches.dtype)  # (B, N * Lp, D)
        pos = vit.pos_embed.to(patches.dtype)
        cls = (vit.cls_token + pos[:, :1]).expand(b, -1, -1).to(patches.dtype)
        patches = patches + pos[:, 1:]
        if self.config.layout == "paper":
            tokens, start = torch.cat([cls, prompts + pos[:, :1], patches], dim=1), 1
        else:
            tokens, start = torch.cat([prompts, cls, patches], dim=1), 0
        out = vit.norm(vit.blocks(vit.norm_pre(vit.pos_drop(tokens))))
        pooled = out[:, start : start + prompts.shape[1]].mean(1)
        return vit.fc_norm(pooled)

    # ----------------------------------------------------------------------------- training
    @torch.no_grad()
    def before_task(self, task: Task) -> None:
        super().before_task(task)
        n = self.config.top_n
        if self.config.diversify == "task_slots" and self.config.shared_prompt_pool and task.id > 0:
            self.prompts[task.id * n : (task.id + 1) * n] = self.prompts[(task.id - 1) * n : task.id * n]
            if self.config.shared_prompt_key:
                self.keys[task.id * n : (task.id + 1) * n] = self.keys[(task.id - 1) * n : task.id * n]
