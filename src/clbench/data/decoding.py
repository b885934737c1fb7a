"""Images decoded on demand, a chunk at a time: a dataset of image files is either decoded into one tensor (the device
store) or written chunk by chunk into the on-disk cache (the streaming store) without ever being whole in memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

CHUNK = 1024  # images decoded per chunk


class LazyImages:
    """``count`` RGB images of ``size`` x ``size`` (uint8): image ``i`` is ``read(i)`` (a file through PIL, a
    torchvision dataset's item through its transform), decoded by ``workers`` threads."""

    def __init__(self, count: int, size: int, workers: int, read: Callable[[int], Any]) -> None:
        self.shape = (count, 3, size, size)
        self.workers, self.read = workers, read

    def __len__(self) -> int:
        return self.shape[0]

    def decode(self, lo: int, hi: int) -> torch.Tensor:
        """Images ``lo .. hi - 1``."""
        with ThreadPoolExecutor(self.workers) as pool:
            images = [torch.as_tensor(x) for x in pool.map(self.read, range(lo, hi))]
        return torch.stack(images) if images else torch.zeros(0, *self.shape[1:], dtype=torch.uint8)

    def chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(first index, images) of each chunk of :data:`CHUNK` images, in order."""
        for lo in range(0, len(self), CHUNK):
            yield lo, self.decode(lo, min(lo + CHUNK, len(self)))

    def materialize(self) -> torch.Tensor:
        """All images in one tensor, filled chunk by chunk (no list of the whole dataset beside it)."""
        out = torch.empty(self.shape, dtype=torch.uint8)
        for lo, chunk in self.chunks():
            out[lo : lo + len(chunk)] = chunk
        return out


def materialized(images: torch.Tensor | LazyImages) -> torch.Tensor:
    """``images`` as a tensor, decoding lazy ones."""
    return images.materialize() if isinstance(images, LazyImages) else images
