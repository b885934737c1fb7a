"""What the prompt methods (L2P, DualPrompt, CODA-Prompt) share over a frozen pretrained ViT.

- The query q(x): the frozen, unprompted backbone's pooled pre-logit feature (the final-norm CLS token for a CLS-pooled
  ViT, as all three official codes), computed without gradients with the same weights.
- Key matching: cosine similarity between q and a pool's keys, the top k per sample (:func:`top_k_by_key`), with the
  official codes' batch-wise vote as an opt-in; selections counted per task for the histograms in results.json.
- The key-pull loss (:func:`pull_loss`): the mean over the batch of the summed cosine distances to the chosen keys.
- Prefix tuning (:class:`PrefixAttention`): prompts prepended to the keys and values of a block's attention, after
  their projection, as DualPrompt's and CODA-Prompt's official codes attach them.
- Training: cross-entropy over the current task's classes (the other seen classes' logits at -inf); the backbone never
  changes; the prompt parameters and the current head (L2P-R: every head its replayed rows reach) train with a fresh
  optimizer each task.
- Heads start as ``method.head_init`` says (:func:`clbench.methods.base.init_head`): nn.Linear's default, or one
  official code's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Attention, VisionTransformer
from torch import nn

from clbench import distributed
from clbench.comparable import method_name
from clbench.data import Benchmark, Task
from clbench.errors import ConfigError
from clbench.methods.attention import head_merge, head_split, split_heads
from clbench.methods.base import Logs, Method, Phase, Replay, init_head

log = logging.getLogger(__name__)


def prompt_init(kind: str, *shape: int, device: torch.device) -> torch.Tensor:
    """Prompts and keys at the start: ``uniform`` U(-1, 1) (the PyTorch codes) or ``small`` U(0, 0.01) (flax's
    default uniform init in the official JAX code)."""
    low, high = (-1.0, 1.0) if kind == "uniform" else (0.0, 0.01)
    return torch.empty(*shape, device=device).uniform_(low, high)


def count_selections(chosen: torch.Tensor, pool_size: int) -> torch.Tensor:
    """How often each prompt of the pool is among ``chosen`` (bincount with a fixed length: ``torch.bincount`` sizes
    its output from the data, a host sync on CUDA in every training step)."""
    flat = chosen.flatten()
    return torch.zeros(pool_size, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def cosine(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """cos(q_b, k_m) for every sample and key: (B, M), in fp32."""
    return F.normalize(query.float(), dim=-1) @ F.normalize(keys.float(), dim=-1).T


def pull_loss(query: torch.Tensor, keys: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """sum over each sample's chosen keys of the cosine distance 1 - cos(q, k), divided by the batch size."""
    return (1 - cosine(query, keys).gather(1, chosen)).sum() / query.shape[0]


def top_k_by_key(similarity: torch.Tensor, k: int, batchwise: bool) -> torch.Tensor:
    """Indices (B, k) of each sample's k most similar keys; ``batchwise``: the official codes' majority vote, every
    sample of the batch takes the batch's k most chosen keys (a prediction then depends on its batch)."""
    chosen = similarity.topk(k, dim=1).indices
    if batchwise:  # ties go to the smaller index, as the JAX code's sorted jnp.unique + lax.top_k
        votes = count_selections(chosen, similarity.shape[1])
        chosen = votes.sort(descending=True, stable=True).indices[:k].expand(len(similarity), k)
    return chosen


def within_depth(key: str, layers: list[int], depth: int) -> list[int]:
    """The configured blocks that the backbone has: a shallower backbone (the embedded micro ViT, 4 blocks) keeps those
    it has, said in the log; none at all is an error."""
    kept = sorted(i for i in set(layers) if i < depth)
    if not kept:
        raise ConfigError(
            f"Invalid value for `{key}`: {layers}. Allowed: block indices below the backbone's depth {depth}."
        )
    if len(kept) < len(set(layers)):
        log.warning("%s=%s: the backbone has %d blocks; prompting blocks %s", key, layers, depth, kept)
    return kept


class PrefixAttention(nn.Module):
    """Wraps a timm ``Attention``: with ``prefix`` set, (B, 2, L, width) key and value vectors prepended to the keys
    and values of every head after their projection (prefix tuning; channel c of a prefix belongs to head
    c // head_dim, as in timm's qkv layout); the queries and the output stay the N tokens'. Without it, the wrapped
    module runs unchanged. Attention stays PyTorch's fused scaled-dot-product attention."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        if not isinstance(attn, Attention):
            raise ConfigError(
                f"Prefix prompts need timm's Attention in every prompted block, not {type(attn).__name__} "
                "(e.g. backbone.refiner=false)."
            )
        self.attn = attn
        self.prefix: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if self.prefix is None:
            return self.attn(x, attn_mask=attn_mask, is_causal=is_causal)
        if attn_mask is not None or is_causal:
            raise ValueError("prefix prompts cannot be combined with another attention mask")
        q, k, v, gate = head_split(self.attn, x)
        prefix = self.prefix.to(q.dtype).expand(len(x), -1, -1, -1)
        k = torch.cat([split_heads(self.attn, prefix[:, 0]), k], dim=2)
        v = torch.cat([split_heads(self.attn, prefix[:, 1]), v], dim=2)
        drop = self.attn.attn_drop.p if self.training else 0.0
        return head_merge(self.attn, F.scaled_dot_product_attention(q, k, v, dropout_p=drop), gate)


def wrap_prefix_layers(vit: VisionTransformer, layers: list[int]) -> dict[int, PrefixAttention]:
    """Prefix attention in each of ``layers``' blocks of ``vit`` (parameters stay the backbone's)."""
    wrapped = {}
    for i in layers:
        block = vit.blocks[i]
        block.attn = wrapped[i] = PrefixAttention(block.attn)
    return wrapped


class PromptMethod(Method):
    """Base of the prompt methods: a frozen backbone, per-task heads whose concatenation is the one class-incremental
    head, the query, a pool of ``pool_size`` keyed prompts (None: no pool) with its selection histograms, and training
    over the current task's classes plus the key-pull term. Subclasses name what they train
    (:meth:`prompt_parameters`), how they pick prompts (:meth:`select`) and how the prompts enter the backbone
    (:meth:`prompted_features`); a method without keyed prompts (CODA-Prompt) overrides ``features`` and
    ``training_loss`` instead."""

    changes_backbone = False

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: Any, pool_size: int | None) -> None:
        super().__init__(backbone, benchmark, config)
        self.backbone.requires_grad_(False)
        self.pool_size = pool_size
        device = backbone.cls_token.device if backbone.cls_token is not None else backbone.pos_embed.device
        if pool_size is not None:
            size = (len(benchmark.tasks), pool_size)
            self.register_buffer("train_counts", torch.zeros(size, dtype=torch.long, device=device))
            self.register_buffer("test_counts", torch.zeros(size, dtype=torch.long, device=device))
        self._eval_task: int | None = None

    def new_head(self, num_classes: int) -> nn.Linear:
        """A head initialised as ``method.head_init`` says."""
        head = super().new_head(num_classes)
        init_head(head, self.config.head_init)
        return head

    def prompt_parameters(self) -> dict[str, nn.Parameter]:
        """What the method trains besides the heads, by name (saved in the run's artifacts under these names)."""
        raise NotImplementedError

    def select(self, q: torch.Tensor, task: Task | None) -> torch.Tensor:
        """The prompts (B, k) each sample uses; ``task`` is set while training it."""
        raise NotImplementedError

    def prompted_features(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The pooled feature of the backbone's pass with the ``chosen`` prompts."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- query and selection
    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's pooled pre-logit feature of ``x``, with whatever prompts its attentions hold."""
        return self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """q(x): the frozen, unprompted ViT's pooled feature, without gradients (no graph, same weights). Not under
        inference mode: its tensors cannot enter a compiled step (torch.compile fails on them inside a graph)."""
        with torch.no_grad():
            return self.pooled(x)

    def record(self, chosen: torch.Tensor, task_id: int | None) -> None:
        """Count a batch's selections: in training under ``task_id``, in evaluation under the evaluated task."""
        counts, row = (self.train_counts, task_id) if task_id is not None else (self.test_counts, self._eval_task)
        if row is not None:
            counts[row] += count_selections(chosen, self.pool_size)

    @contextmanager
    def evaluating(self, task_id: int) -> Iterator[None]:
        """Bins the test-time prompt selections by the evaluated task (diagnostics only: never used to predict)."""
        self._eval_task = task_id
        try:
            yield
        finally:
            self._eval_task = None

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """The prompts are chosen by the query alone: the task id is never used to pick them at test time."""
        chosen = self.select(self.query(x), None)
        self.record(chosen, None)
        return self.prompted_features(x, chosen)

    # ----------------------------------------------------------------------------- training
    def training_loss(
        self, x: torch.Tensor, y: torch.Tensor, task: Task, replay: tuple[Replay, ...] = ()
    ) -> tuple[torch.Tensor, Logs]:
        """Cross-entropy over the current task's classes + ``pull`` x the key-pull term of the chosen prompts. With a
        memory (L2P-R), the replayed rows join the batch, their cross-entropy over every class of
        :meth:`training_logits` (the official code's ``replay_no_mask``): the mean over all rows."""
        rows = torch.cat([x, *(r.x for r in replay)]) if replay else x
        q = self.query(rows)
        chosen = self.select(q, task)
        self.record(chosen[: len(y)], task.id)
        logits = self.training_logits(self.prompted_features(rows, chosen))
        ce = self.current_task_ce(logits[: len(y)], y, task)
        if replay:
            memory_y = torch.cat([r.y for r in replay])
            replayed = F.cross_entropy(logits[len(y) :], memory_y, reduction="sum")
            ce = (ce * len(y) + replayed) / len(rows)
        pull = pull_loss(q, self.keys, chosen)
        return ce + self.config.pull * pull, {"pull": pull.detach()}

    def training_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """The logits the training loss reads: every seen class's."""
        return self.seen_logits(feats)

    def trained_heads(self, task: Task) -> list[nn.Linear]:
        """The heads a task trains: its own (the other classes' logits are masked: their rows get no gradient)."""
        return [self.heads[task.id]]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        trained = {id(head) for head in self.trained_heads(task)}
        for head in self.heads:
            head.requires_grad_(id(head) in trained)
        heads = [p for head in self.trained_heads(task) for p in head.parameters()]
        return [{"params": [*self.prompt_parameters().values(), *heads], "weight_decay": 0.0}]

    @staticmethod
    def current_task_ce(logits: torch.Tensor, y: torch.Tensor, task: Task) -> torch.Tensor:
        """Cross-entropy over the current task's classes of logits over every seen class (the others at -inf), with
        global labels: what all three official codes train (``train_mask``)."""
        outside = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
        outside[task.offset : task.offset + task.num_classes] = False
        return F.cross_entropy(logits.masked_fill(outside, float("-inf")), y)

    def after_task(self, task: Task) -> None:
        super().after_task(task)
        if self.pool_size is not None:
            # Each rank of a multi-process run counted its share of the batches (a run resumed mid-task under torchrun
            # counts the interrupted part of the task once per rank: a histogram-only difference).
            distributed.current().sum_(self.train_counts[task.id])
            self.test_counts.zero_()  # the histogram of the evaluation that follows

    # ----------------------------------------------------------------------------- bookkeeping
    def forwards_per_test_image(self) -> dict[str, int]:
        """Two passes in both scenarios: the unprompted query pass, then the prompted pass (the task id never picks
        the prompts)."""
        return {"til": 2, "cil": 2}

    def storage(self) -> dict[str, Any]:
        """Per task, the head; the prompt parameters shared by all tasks (subclasses move per-task slices to the
        task)."""
        out = super().storage()
        out["shared_bits"] = {name: 32 * p.numel() for name, p in self.prompt_parameters().items()}
        return out

    def extra_results(self) -> dict[str, Any]:
        """The prompt-selection histograms under the method's name (pool collapse shows as the same bars for every
        task), and whether the batch-wise vote was on."""
        if self.pool_size is None:
            return {}
        seen = self.num_seen
        test = distributed.current().sum_(self.test_counts[:seen].clone()).tolist()
        histogram = {"train": self.train_counts[:seen].tolist(), "test": test}
        name = method_name(f"{type(self).__module__}.{type(self).__name__}")
        return {name: {"batchwise_prompt": self.config.batchwise_prompt, "prompt_histogram": histogram}}

    def artifacts(self) -> dict[str, torch.Tensor]:
        return super().artifacts() | {k: p.detach().clone() for k, p in self.prompt_parameters().items()}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for name, p in self.prompt_parameters().items():
            p.copy_(tensors[name])
