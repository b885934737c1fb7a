"""Batched image transforms on the training device: no PIL.

Training crops, flips and resizes in one ``F.grid_sample`` per batch with a per-sample affine grid:
``pad`` shifts each image by up to ``crop_padding`` pixels with zero fill (the CIFAR pad-and-crop recipe),
``resized`` samples a RandomResizedCrop box (area ``resized_crop_scale``, aspect ratio 3/4..4/3).
Optionally, per image as DeiT trains: torchvision's RandAugment (``data.randaugment_ops``) on the cropped image and
timm's random erasing (``data.random_erasing``) after normalisation; these two loop over the batch's images.
Evaluation resizes with antialiasing, straight to the backbone's size or (``data.test_resize``) to that size and then
a centre crop. Both then normalise with the backbone's mean/std.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.data.random_erasing import RandomErasing
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from clbench.config import DataConfig


class DeviceTransform:
    """uint8 (B, C, H, W) -> float (B, 3, S, S), normalised; ``train`` enables the random augmentation."""

    def __init__(
        self,
        cfg: DataConfig,
        out_size: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        *,
        train: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg, self.out_size, self.train = cfg, out_size, train
        # On the batches' device from the start: a copy from host memory in every step would be a host sync.
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)

    def __call__(self, images: torch.Tensor, part: slice = slice(None)) -> torch.Tensor:
        """Transform ``images[part]``. The random augmentation parameters are drawn for the whole batch, so each
        rank of a multi-process run transforms its share exactly as a single process would (the per-image
        augmentations, RandAugment and random erasing, run on the whole batch and then keep the share)."""
        per_image = self.train and bool(self.cfg.randaugment_ops or self.cfg.random_erasing)
        x = (images if per_image else images[part]).float().div_(255.0)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if self.train and (self.cfg.train_crop != "none" or self.cfg.hflip):
            theta = self._affine(len(images), *images.shape[-2:], x.device)
            theta = theta if per_image else theta[part]
            grid = F.affine_grid(theta, [len(x), x.shape[1], self.out_size, self.out_size], align_corners=False)
            x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        elif not self.train and self.cfg.test_resize:
            x = resize_center_crop(x, self.cfg.test_resize, self.out_size)
        elif x.shape[-1] != self.out_size or x.shape[-2] != self.out_size:
            x = F.interpolate(x, size=(self.out_size, self.out_size), mode="bilinear", antialias=True)
        if self.train and self.cfg.randaugment_ops:
            x = self._rand_augment(x)
        x = (x - self.mean) / self.std
        if self.train and self.cfg.random_erasing:
            x = RandomErasing(self.cfg.random_erasing, mode="pixel", device=str(x.device))(x)
        return x[part] if per_image else x

    def _rand_augment(self, x: torch.Tensor) -> torch.Tensor:
        """torchvision's RandAugment, drawn per image (its ops need uint8 pixels: quantised and back)."""
        augment = v2.RandAugment(self.cfg.randaugment_ops, self.cfg.randaugment_magnitude)
        pixels = x.mul(255).round_().to(torch.uint8)
        return torch.stack([augment(image) for image in pixels]).float().div_(255.0)

    def _affine(self, b: int, h: int, w: int, dev: torch.device) -> torch.Tensor:
        """Random (b, 2, 3) crop + flip matrices in normalised coordinates for b images of h x w pixels."""
        scale_x = torch.ones(b, device=dev)
        scale_y = torch.ones(b, device=dev)
        shift_x = torch.zeros(b, device=dev)
        shift_y = torch.zeros(b, device=dev)
        if self.cfg.train_crop == "pad":
            p = self.cfg.crop_padding
            shift_x = torch.randint(-p, p + 1, (b,), device=dev) * (2.0 / w)
            shift_y = torch.randint(-p, p + 1, (b,), device=dev) * (2.0 / h)
        elif self.cfg.train_crop == "resized":
            lo, hi = self.cfg.resized_crop_scale
            area = torch.empty(b, device=dev).uniform_(lo, hi)
            log_ratio = torch.empty(b, device=dev).uniform_(math.log(3 / 4), math.log(4 / 3))
            ratio = log_ratio.exp()
            scale_x = (area * ratio).sqrt().clamp(max=1.0)
            scale_y = (area / ratio).sqrt().clamp(max=1.0)
            shift_x = (torch.rand(b, device=dev) * 2 - 1) * (1 - scale_x)
            shift_y = (torch.rand(b, device=dev) * 2 - 1) * (1 - scale_y)
        if self.cfg.hflip:
            scale_x = scale_x * (torch.randint(0, 2, (b,), device=dev) * 2 - 1)
        theta = torch.zeros(b, 2, 3, device=dev)
        theta[:, 0, 0], theta[:, 0, 2] = scale_x, shift_x
        theta[:, 1, 1], theta[:, 1, 2] = scale_y, shift_y
        return theta


def resize_center_crop(x: torch.Tensor, resize: int, crop: int) -> torch.Tensor:
    """torchvision's Resize(resize) + CenterCrop(crop), applied to the whole batch on its device."""
    return TF.center_crop(TF.resize(x, [resize], antialias=True), [crop, crop])
