"""L2P (Wang et al., "Learning to Prompt for Continual Learning", CVPR 2022): a prompt pool over a frozen ViT.

A pool of M prompts P_j (Lp tokens of width D each) with learnable keys k_j. The query q(x) is the frozen,
unprompted ViT's pooled pre-logit feature (final-norm CLS token for a CLS-pooled ViT), computed under
inference mode with the same weights; the N prompts whose keys are most cosine-similar to q(x) are
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
  (``shared_prompt_pool``).
- ``batchwise_prompt=true`` (both codes): every sample of a batch uses the batch's N most-selected prompts,
  at train and test, so a prediction depends on its batch. Off by default; recorded in results.json.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench import distributed
from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.base import Logs, Method, Phase


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
    batchwise_prompt: bool = False  # the codes' per-batch majority vote (predictions depend on the batch)
    prompt_init: str = "uniform"  # uniform: U(-1, 1) (PyTorch code) | small: U(0, 0.01) (JAX code)

    def __post_init__(self) -> None:
        require(self.pool_size >= 1, "method.pool_size", self.pool_size, "an integer >= 1")
        require(1 <= self.top_n <= self.pool_size, "method.top_n", self.top_n, "an integer in [1, pool_size]")
        require(self.prompt_length >= 1, "method.prompt_length", self.prompt_length, "an integer >= 1")
        require(self.pull >= 0, "method.pull", self.pull, "a float >= 0")
        require_choice("method.layout", self.layout, ("paper", "dualprompt"))
        require_choice("method.diversify", self.diversify, ("none", "frequency", "task_slots"))
        require_choice("method.prompt_init", self.prompt_init, ("uniform", "small"))


def count_selections(chosen: torch.Tensor, pool_size: int) -> torch.Tensor:
    """How often each prompt of the pool is among ``chosen`` (bincount with a fixed length: ``torch.bincount`` sizes
    its output from the data, a host sync on CUDA in every training step)."""
    flat = chosen.flatten()
    return torch.zeros(pool_size, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def pull_loss(query: torch.Tensor, keys: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """sum over each sample's chosen keys of the cosine distance 1 - cos(q, k), divided by the batch size."""
    sim = F.normalize(query.float(), dim=-1) @ F.normalize(keys.float(), dim=-1).T  # (B, M)
    return (1 - sim.gather(1, chosen)).sum() / query.shape[0]


class L2P(Method):
    Config = L2PConfig
    changes_backbone = False

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: L2PConfig) -> None:
        super().__init__(backbone, benchmark, config)
        if backbone.cls_token is None or backbone.num_prefix_tokens != 1 or getattr(backbone, "no_embed_class", False):
            raise ConfigError("L2P needs a ViT with one class token and a position embedding for it (timm's default).")
        if config.diversify == "task_slots" and config.pool_size < len(benchmark.tasks) * config.top_n:
            raise ConfigError(
                f"Invalid value for `method.pool_size`: {config.pool_size}. Allowed with diversify=task_slots: "
                f">= tasks x top_n = {len(benchmark.tasks) * config.top_n}."
            )
        self.backbone.requires_grad_(False)
        m, length, dim = config.pool_size, config.prompt_length, backbone.embed_dim
        device = backbone.cls_token.device
        low, high = (-1.0, 1.0) if config.prompt_init == "uniform" else (0.0, 0.01)
        self.prompts = nn.Parameter(torch.empty(m, length, dim, device=device).uniform_(low, high))
        self.keys = nn.Parameter(torch.empty(m, dim, device=device).uniform_(low, high))
        self.register_buffer("train_counts", torch.zeros(len(benchmark.tasks), m, dtype=torch.long, device=device))
        self.register_buffer("test_counts", torch.zeros(len(benchmark.tasks), m, dtype=torch.long, device=device))
        self._eval_task: int | None = None

    # ----------------------------------------------------------------------------- query and selection
    def query(self, x: torch.Tensor) -> torch.Tensor:
        """q(x): the frozen, unprompted ViT's pooled feature, under inference mode (no graph, same weights)."""
        with torch.inference_mode():
            q = self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)
        return q.clone()  # a normal tensor again, usable in the pull loss

    def select(self, q: torch.Tensor, task: Task | None) -> torch.Tensor:
        """Indices (B, N) of the prompts each sample uses; ``task`` is set while training it."""
        cfg = self.config
        n = cfg.top_n
        if task is not None and cfg.diversify == "task_slots":
            slot = torch.arange(task.id * n, (task.id + 1) * n, device=q.device)
            return slot.expand(len(q), n)
        sim = F.normalize(q.float(), dim=-1) @ F.normalize(self.keys.float(), dim=-1).T
        if task is not None and cfg.diversify == "frequency" and task.id > 0:
            counts = self.train_counts[: task.id].sum(0).float()
            chosen = ((1 - sim) * counts / counts.sum()).topk(n, dim=1, largest=False).indices
        else:
            chosen = sim.topk(n, dim=1).indices
        if cfg.batchwise_prompt:
            votes = count_selections(chosen, cfg.pool_size)
            chosen = votes.topk(n).indices.expand(len(q), n)
        return chosen

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

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """The selection uses the query only; the task id is never used to pick prompts at test time."""
        chosen = self.select(self.query(x), None)
        if self._eval_task is not None:
            self.test_counts[self._eval_task] += count_selections(chosen, self.config.pool_size)
        return self.prompted_features(x, chosen)

    def task_logits(self, x: torch.Tensor, task_id: int) -> torch.Tensor:
        """TIL: the task's own classes' logits of the one head."""
        return self.heads[task_id](self.features(x, task_id))

    @contextmanager
    def evaluating(self, task_id: int) -> Iterator[None]:
        """Bins the test-time prompt selections by the evaluated task (diagnostics only: never used to predict)."""
        self._eval_task = task_id
        try:
            yield
        finally:
            self._eval_task = None

    # ----------------------------------------------------------------------------- training
    @torch.no_grad()
    def before_task(self, task: Task) -> None:
        super().before_task(task)
        n = self.config.top_n
        if self.config.diversify == "task_slots" and self.config.shared_prompt_pool and task.id > 0:
            self.prompts[task.id * n : (task.id + 1) * n] = self.prompts[(task.id - 1) * n : task.id * n]
            self.keys[task.id * n : (task.id + 1) * n] = self.keys[(task.id - 1) * n : task.id * n]

    def after_task(self, task: Task) -> None:
        super().after_task(task)
        # Each rank of a multi-process run counted its share of the batches (a run resumed mid-task under torchrun
        # counts the interrupted part of the task once per rank: a histogram-only difference).
        distributed.current().sum_(self.train_counts[task.id])
        self.test_counts.zero_()  # the histogram of the evaluation that follows

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        for t, head in enumerate(self.heads):
            head.requires_grad_(t == task.id)  # other classes' logits are masked: their rows get no gradient
        return [{"params": [self.prompts, self.keys, *self.heads[task.id].parameters()], "weight_decay": 0.0}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        q = self.query(x)
        chosen = self.select(q, task)
        self.train_counts[task.id] += count_selections(chosen, self.config.pool_size)
        logits = self.seen_logits(self.prompted_features(x, chosen))
        outside = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
        outside[task.offset : task.offset + task.num_classes] = False
        ce = F.cross_entropy(logits.masked_fill(outside, float("-inf")), y)
        pull = pull_loss(q, self.keys, chosen)
        return ce + self.config.pull * pull, {"pull": pull.detach()}

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Nothing per task but the head's rows; the pool (prompts and keys) is shared by all tasks."""
        out = super().storage()
        out["shared_bits"] = {"prompts": 32 * self.prompts.numel(), "keys": 32 * self.keys.numel()}
        return out

    def extra_results(self) -> dict[str, Any]:
        """The prompt-selection histograms (pool collapse shows as the same N bars for every task)."""
        seen = self.num_seen
        return {
            "l2p": {
                "batchwise_prompt": self.config.batchwise_prompt,
                "prompt_histogram": {
                    "train": self.train_counts[:seen].tolist(),
                    "test": distributed.current().sum_(self.test_counts[:seen].clone()).tolist(),
                },
            }
        }

    def artifacts(self) -> dict[str, torch.Tensor]:
        return super().artifacts() | {"prompts": self.prompts.detach().clone(), "keys": self.keys.detach().clone()}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.prompts.copy_(tensors["prompts"])
        self.keys.copy_(tensors["keys"])
