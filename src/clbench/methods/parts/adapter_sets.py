"""AdaptFormer adapter sets side by side on one ViT, one set per task, the ViT run through any one of them or none.

A set is one :class:`~clbench.methods.parts.adaptformer.AdaptFormer` per block (EASE's ``cur_adapter`` and
``adapter_list``, sun-hailong/CVPR24-Ease@6d67508 backbone/vit_ease.py L255-302). Each block's MLP is wrapped once
(:func:`~clbench.methods.parts.adaptformer.wrap_blocks`) with an :class:`AdapterBank` beside it, which holds that
block's adapter of every set and runs the selected one; :class:`AdapterSets` is the handle that adds a fresh set to
every block and selects a set in every block at once. With no set selected the ViT computes exactly the pretrained
ViT (each wrapper switched off). A new set starts fresh or as a copy of an earlier one (an adapter continued from the
previous task's: MOS's and TUNA's ``cur_adapter``, sun-hailong/AAAI25-MOS@8d5e07c backbone/vit_mos.py L256-263).

:class:`SetSums` keeps prefix sums of finished sets (MOS's ``sum_adapter_param``, vit_mos.py L310-326), and
:func:`pull` is the merge map that moves a set toward their mean (``reweight_adapter``, L328-346):
A <- (1 - m) A + m S_{i-1} / i, the mean of sets 0 .. i-1 as they were when each finished.

The selection is a plain attribute read in the forward: a training phase selects its set once (:meth:`AdapterSets.
select`), so a compiled or graph-replayed step sees a constant; :meth:`AdapterSets.use` runs a block of code through
another set and gives the previous selection back (an evaluation in the middle of a phase).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.methods.parts.adaptformer import AdapterConfig, ParallelAdapterMlp, new_adapter, wrap_blocks


class AdapterBank(nn.Module):
    """One block's adapters, one per set (``sets[k]``), and the index of the one its block runs."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = nn.ModuleList()
        self.index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sets[self.index](x)


class AdapterSets:
    """The adapter sets attached to a ViT (held, not owned: the banks are the ViT's modules): ``len()`` sets, set
    ``k`` made of block ``i``'s ``banks[i].sets[k]``."""

    def __init__(self, vit: VisionTransformer, config: AdapterConfig) -> None:
        self.vit = vit
        self.config = config
        self.wrappers: list[ParallelAdapterMlp] = wrap_blocks(vit, AdapterBank)
        self.selected: int | None = None
        self.running: int | None = None
        self._switch(None)

    @property
    def banks(self) -> list[AdapterBank]:
        return [wrapper.adapter for wrapper in self.wrappers]

    def __len__(self) -> int:
        return len(self.banks[0].sets)

    def add(self, like: int | None = None) -> int:
        """A new set in every block, trainable: fresh (W_up = 0: the ViT through it is the pretrained one until it
        trains) or, with ``like``, a copy of set ``like``'s current values; returns its index."""
        for bank in self.banks:
            adapter = self.fresh()
            if like is not None:
                adapter.load_state_dict(bank.sets[like].state_dict())
            bank.sets.append(adapter)
        return len(self) - 1

    def fresh(self) -> nn.Module:
        c = self.config
        return new_adapter(self.vit, c.bottleneck, c.adapter_scale, c.adapter_dropout)

    @torch.no_grad()
    def reset(self, k: int) -> None:
        """Fresh values (a new initialisation) into set ``k``."""
        for bank in self.banks:
            bank.sets[k].load_state_dict(self.fresh().state_dict())

    def pop(self) -> None:
        """Remove the newest set."""
        for bank in self.banks:
            del bank.sets[len(bank.sets) - 1]

    def parameters(self, k: int) -> list[nn.Parameter]:
        """Set ``k``'s parameters, block by block."""
        return [p for bank in self.banks for p in bank.sets[k].parameters()]

    def numel(self, k: int) -> int:
        return sum(p.numel() for p in self.parameters(k))

    def freeze(self, k: int) -> None:
        for p in self.parameters(k):
            p.requires_grad_(False)

    def select(self, k: int | None) -> None:
        """Run the ViT through set ``k`` from now on (None: no set, the pretrained ViT)."""
        self.selected = k
        self._switch(k)

    def _switch(self, k: int | None) -> None:
        self.running = k  # the set the ViT runs through now (within ``use`` too)
        for wrapper in self.wrappers:
            wrapper.active = k is not None
            wrapper.adapter.index = k or 0

    @contextmanager
    def use(self, k: int | None) -> Iterator[None]:
        """Run the ViT through set ``k`` (None: the pretrained ViT) within the block, then the selection before."""
        self._switch(k)
        try:
            yield
        finally:
            self._switch(self.selected)

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every set's tensors as ``{prefix + "<k>.<block>.<name>": copy}`` (a run's artifacts)."""
        return {
            f"{prefix}{k}.{i}.{name}": value.detach().clone()
            for i, bank in enumerate(self.banks)
            for k, adapter in enumerate(bank.sets)
            for name, value in adapter.state_dict().items()
        }

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Add as many sets as :meth:`state`'s ``tensors`` hold and copy them in; they stay frozen."""
        sets = {int(key[len(prefix) :].split(".")[0]) for key in tensors if key.startswith(prefix)}
        while len(self) < len(sets):
            self.freeze(self.add())
        for i, bank in enumerate(self.banks):
            for k, adapter in enumerate(bank.sets):
                adapter.load_state_dict({n: tensors[f"{prefix}{k}.{i}.{n}"] for n in adapter.state_dict()})


class SetSums(nn.Module):
    """Prefix sums of finished adapter sets, one fp32 buffer per tensor of a set (in :meth:`AdapterSets.parameters`
    order): ``S_i = S_{i-1} + set i`` taken when set i finishes (MOS's ``sum_adapter_param``), so the mean of sets
    0 .. i-1 is what they were then, whatever happens to them later."""

    def __init__(self) -> None:
        super().__init__()
        self.sums = nn.ModuleList()

    def __len__(self) -> int:
        return len(self.sums)

    @torch.no_grad()
    def add(self, sets: AdapterSets, k: int) -> None:
        """S_{len} = S_{len-1} + set ``k`` (its values now)."""
        previous = list(self.sums[-1].buffers()) if len(self.sums) else None
        block = nn.Module()
        for n, p in enumerate(sets.parameters(k)):
            total = p.detach().float().clone()
            block.register_buffer(f"s{n}", total if previous is None else total + previous[n])
        self.sums.append(block)

    def mean(self, i: int) -> list[torch.Tensor]:
        """S_{i-1} / i: the mean of the first ``i`` >= 1 finished sets."""
        return [s / i for s in self.sums[i - 1].buffers()]

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}{i}.{name}": b.clone() for i, block in enumerate(self.sums) for name, b in block.named_buffers()
        }

    @torch.no_grad()
    def load(self, sets: AdapterSets, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Rebuild :meth:`state`'s sums (as many as ``tensors`` hold) over ``sets``'s layout."""
        count = len({key[len(prefix) :].split(".")[0] for key in tensors if key.startswith(prefix)})
        while len(self) < count:
            self.add(sets, 0)
        for i, block in enumerate(self.sums):
            for name, b in block.named_buffers():
                b.copy_(tensors[f"{prefix}{i}.{name}"])


@torch.no_grad()
def pull(params: list[torch.Tensor], target: list[torch.Tensor], momentum: float, *, in_place: bool = True) -> None:
    """The merge map p <- (1 - m) p + m target for each tensor, on ``.data`` (untracked by autograd). In place keeps
    the tensors where they are (a captured step's static addresses); ``in_place=False`` assigns ``.data`` a new tensor,
    as MOS's code does in its forward, so that a block that already used the old values is differentiated at them."""
    for p, t in zip(params, target, strict=True):
        if in_place:
            p.data.mul_(1 - momentum).add_(t.to(p.dtype), alpha=momentum)
        else:
            p.data = p.data * (1 - momentum) + momentum * t.to(p.dtype)
