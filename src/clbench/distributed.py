"""One run over several processes started by ``torchrun`` (PyTorch DistributedDataParallel).

``torchrun --nproc_per_node=N -m clbench ...`` starts N ranks. Every rank builds the same method and benchmark from
the same seed and draws the same random numbers (epoch order, augmentation parameters, MEAT's Gumbel noise, adapter
dropout), so the ranks stay in lockstep. Each takes its contiguous share of every global batch
(``trainer.batch_size`` is the global batch); DDP averages the gradients during backward, so one step equals a
single-process step on the whole batch up to floating-point summation order. Evaluation is sharded the same way and
its counts summed over ranks. Only rank 0 writes the run folder, checkpoints and W&B. Backend: NCCL on CUDA (one GPU
per rank, ``LOCAL_RANK``), gloo on CPU.
"""

from __future__ import annotations

import atexit
import inspect
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


def share_bounds(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous rows [lo, hi) of a batch of ``n`` split over ``size`` ranks: ceil(n / size) each, the
    last ones short or empty."""
    per = -(-n // size)
    return min(rank * per, n), min((rank + 1) * per, n)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``size`` (a single process is rank 0 of 1)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> tuple[slice, float]:
        """This rank's contiguous share of a batch of ``n`` and the weight its mean loss gets, so that the ranks'
        averaged gradients equal those of the whole batch's mean loss (exactly 1 when ``n`` divides evenly). A rank
        left without samples (a last batch smaller than the world) takes one sample with weight 0."""
        if self.size == 1:
            return slice(None), 1.0
        lo, hi = share_bounds(n, self.size, self.rank)
        if lo == hi:
            return slice(0, 1), 0.0
        return slice(lo, hi), (hi - lo) * self.size / n

    def rows(self, mirrored: bool = False) -> ShareRows | None:
        """What a rank reads of each batch from the on-disk cache: its share (and with ``mirrored``, the rows
        mixup/cutmix pair with it); None for a single process, which reads every row."""
        return ShareRows(self, mirrored) if self.size > 1 else None

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def complete_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """A streamed batch whose rows each rank read only in part (the others zero) made whole on every rank: the
        element-wise max over the ranks (rows read by two ranks, as mixup's mirrored ones, are equal)."""
        whole = batch.clone()
        dist.all_reduce(whole, op=dist.ReduceOp.MAX)
        return whole

    def gather_rows(self, part: torch.Tensor, n: int) -> torch.Tensor:
        """The rows of a batch of ``n`` that each rank holds its :meth:`shard` of, put together on every rank."""
        per = -(-n // self.size)
        lo, hi = min(self.rank * per, n), min((self.rank + 1) * per, n)
        padded = part.new_zeros((per, *part.shape[1:]))
        padded[: hi - lo] = part[: hi - lo]
        pieces = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(pieces, padded.contiguous())
        return torch.cat(pieces)[:n]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``module`` under DDP (gradients averaged during backward); only for a run of several ranks. The wrapper
        lives for one phase, in which a method uses the same parameters at every step: a static graph, whose unused
        parameters (other tasks' heads, say) DDP finds once, at the first step. Buffers (masks, owners, counters)
        are not re-broadcast at every forward: the ranks compute the same updates, and DDP aligns them when it
        wraps, but for a rehearsal memory's: every rank inserts the same images, and the memory (gigabytes, maybe
        in pinned host memory) is not sent again at each phase."""
        from clbench.memory import Memory  # here: the memory's module imports the data's, which import this one

        ddp = nn.parallel.DistributedDataParallel
        memories = [name for name, sub in module.named_modules() if isinstance(sub, Memory)]
        kept = [f"{name}.{buffer}" for name in memories for buffer, _ in module.get_submodule(name).named_buffers()]
        ddp._set_params_and_buffers_to_ignore_for_model(module, kept)
        no_forward_sync = (  # the flag's name since torch 2.15; the old one before
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(ddp).parameters
            else {"broadcast_buffers": False}
        )
        ids = [device.index] if device.type == "cuda" else None
        return ddp(module, device_ids=ids, static_graph=True, **no_forward_sync)

    def agree(self, signum: int | None) -> int | None:
        """A stop signal any rank received, on every rank (so all ranks checkpoint and stop at the same step)."""
        if self.size == 1:
            return signum
        flag = torch.tensor([signum or 0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None


@dataclass(frozen=True)
class ShareRows:
    """Batch size -> the positions of the batch a rank reads: its :meth:`Ranks.shard`, and with ``mirrored`` also
    position ``n - 1 - i`` of each of them, which timm's Mixup mixes into row ``i`` (an odd batch is not mixed)."""

    ranks: Ranks
    mirrored: bool

    def __call__(self, n: int) -> np.ndarray:
        share = np.arange(n)[self.ranks.shard(n)[0]]
        return np.union1d(share, n - 1 - share) if self.mirrored and n % 2 == 0 else share


def current() -> Ranks:
    """The run's ranks: those of the initialised process group, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def init(device: str) -> Ranks:
    """Join the process group torchrun describes in the environment (NCCL for CUDA, gloo for CPU), left again when
    the process exits; a no-op for a single process. ``device`` is ``trainer.device``."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return current()
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    atexit.register(leave, together=False)  # a rank that failed leaves alone (the others may never get here)
    return current()


def leave(together: bool = True) -> None:
    """Leave the process group, if in one. ``together`` (a finished run): wait for every rank first, so that no rank
    exits while another still has the group open; a rank whose peer had gone while gloo's threads still read from it
    could abort (SIGABRT) after a run whose results were already written."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if together:
        dist.barrier()
    dist.destroy_process_group()
