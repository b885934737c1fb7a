"""Batched image transforms on the training device: no PIL.

Training crops, flips and resizes in one ``F.grid_sample`` per batch with a per-sample affine grid:
``pad`` shifts each image by up to ``crop_padding`` pixels with zero fill (the CIFAR pad-and-crop recipe),
``resized`` samples a RandomResizedCrop box (area ``resized_crop_scale``, aspect ratio 3/4..4/3).
``data.brightness`` scales each training image's pixels by a drawn factor (torchvision's ColorJitter brightness).
Optionally, per image as DeiT trains: torchvision's RandAugment (``data.randaugment_ops``) on the cropped image and
timm's random erasing (``data.random_erasing``) after normalisation; these two loop over the batch's images.
Evaluation resizes with antialiasing, straight to the backbone's size or (``data.test_resize``) to that size and then
a centre crop. Both then normalise with the backbone's mean/std.

``data.transforms=pilot`` is PILOT's ``build_transform`` as torchvision computes it on PIL images: crop boxes drawn by
``RandomResizedCrop.get_params`` (whole pixels, ten tries, then the centre crop), the crop resampled bilinearly from
its own pixels only, the test resize with PIL's bicubic filter (a = -0.5, antialiased), and every output rounded to
8 bits as PIL's images are before ``ToTensor``.
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
        pilot = self.cfg.transforms == "pilot"
        if self.train and pilot:
            x = torchvision_resized_crops(x, len(images), part, self.out_size, self.cfg.resized_crop_scale)
        elif self.train and (self.cfg.train_crop != "none" or self.cfg.hflip):
            theta = self._affine(len(images), *images.shape[-2:], x.device)
            theta = theta if per_image else theta[part]
            grid = F.affine_grid(theta, [len(x), x.shape[1], self.out_size, self.out_size], align_corners=False)
            x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        elif not self.train and self.cfg.test_resize:
            x = (pil_bicubic_center_crop if pilot else resize_center_crop)(x, self.cfg.test_resize, self.out_size)
        elif x.shape[-1] != self.out_size or x.shape[-2] != self.out_size:
            x = F.interpolate(x, size=(self.out_size, self.out_size), mode="bilinear", antialias=True)
        if self.train and self.cfg.brightness:
            x = brightness_jitter(x, len(images), slice(None) if per_image else part, self.cfg.brightness)
        if pilot:
            x = eight_bits(x)  # PIL's 8-bit image, then ToTensor
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


def brightness_jitter(x: torch.Tensor, batch: int, part: slice, strength: float) -> torch.Tensor:
    """torchvision's ColorJitter(brightness=strength) on pixels in [0, 1]: each image times a factor from
    U[max(0, 1 - strength), 1 + strength], clipped; drawn on the device for the whole batch of ``batch`` images, then
    cut to ``part`` (a rank's share)."""
    factors = torch.empty(batch, device=x.device).uniform_(max(0.0, 1 - strength), 1 + strength)[part]
    return (x * factors.view(-1, 1, 1, 1)).clamp_(0.0, 1.0)


def resize_center_crop(x: torch.Tensor, resize: int, crop: int) -> torch.Tensor:
    """torchvision's Resize(resize) + CenterCrop(crop), applied to the whole batch on its device."""
    return TF.center_crop(TF.resize(x, [resize], antialias=True), [crop, crop])


def torchvision_crop_boxes(
    b: int, h: int, w: int, scale: tuple[float, float], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """``b`` boxes (top, left, height, width; whole pixels) as torchvision's ``RandomResizedCrop.get_params`` draws
    them on an h x w image with ratio (3/4, 4/3): up to ten tries of an area share in ``scale`` and a log-uniform
    ratio, rounded to pixels, the first that fits kept, at a uniform position; none fits: the centre crop, its ratio
    clamped to the range."""
    f64 = dict(device=device, dtype=torch.float64)
    area = h * w * torch.empty(b, 10, **f64).uniform_(*scale)
    ratio = torch.empty(b, 10, **f64).uniform_(math.log(3 / 4), math.log(4 / 3)).exp()
    cw, ch = (area * ratio).sqrt().round(), (area / ratio).sqrt().round()
    fits = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # the first try that fits
    found = fits.any(1)
    in_ratio = w / h
    fw, fh = (w, round(w / (3 / 4))) if in_ratio < 3 / 4 else (round(h * 4 / 3), h) if in_ratio > 4 / 3 else (w, h)
    cw = torch.where(found, cw.gather(1, first)[:, 0], float(fw))
    ch = torch.where(found, ch.gather(1, first)[:, 0], float(fh))
    top = torch.where(found, (torch.rand(b, **f64) * (h - ch + 1)).floor(), float((h - fh) // 2))
    left = torch.where(found, (torch.rand(b, **f64) * (w - cw + 1)).floor(), float((w - fw) // 2))
    return top, left, ch, cw


def torchvision_resized_crops(
    x: torch.Tensor, b: int, part: slice, out: int, scale: tuple[float, float]
) -> torch.Tensor:
    """RandomResizedCrop(out, scale) + RandomHorizontalFlip(0.5) as torchvision applies them to PIL images, on this
    rank's ``part`` of a batch of ``b`` (the draws are made for the whole batch): each box cut out, resized with PIL's
    bilinear filter (antialiased when it shrinks), then flipped with probability 1/2."""
    h, w = x.shape[-2:]
    top, left, ch, cw = (v[part] for v in torchvision_crop_boxes(b, h, w, tuple(scale), x.device))
    flip = (torch.rand(b, device=x.device) < 0.5)[part]
    cropped = pil_resize(x, pil_weights(top, ch, h, out, "bilinear"), pil_weights(left, cw, w, out, "bilinear"))
    return torch.where(flip[:, None, None, None], cropped.flip(-1), cropped)


def pil_weights(start: torch.Tensor, length: torch.Tensor, size: int, out: int, kind: str) -> torch.Tensor:
    """(B, out, size): PIL's resampling of pixels ``start .. start + length - 1`` (per image) of a side of ``size``
    pixels to ``out`` (``precompute_coeffs``): output pixel o reads the pixels around (o + 0.5) * length / out,
    weighted by the bilinear (triangle) or bicubic (a = -0.5) filter, widened by the shrinking factor
    (antialiasing), the taps outside the box left out and the rest normalised to sum to one."""
    start, length = start.to(torch.float64).reshape(-1, 1, 1), length.to(torch.float64).reshape(-1, 1, 1)
    device = start.device
    scale = length / out
    stretch = scale.clamp(min=1.0)
    center = (torch.arange(out, device=device, dtype=torch.float64)[None, :, None] + 0.5) * scale
    x = torch.arange(size, device=device, dtype=torch.float64)[None, None, :] - start  # in the box's coordinates
    t = ((x + 0.5 - center) / stretch).abs()
    if kind == "bilinear":
        weights = (1 - t).clamp(min=0)
    else:
        weights = torch.where(
            t < 1, (1.5 * t - 2.5) * t * t + 1, torch.where(t < 2, (((t - 5) * t + 8) * t - 4) * -0.5, 0)
        )
    weights = weights * ((x >= 0) & (x < length))
    return (weights / weights.sum(-1, keepdim=True)).float()


def pil_resize(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``x`` (B, C, H, W) resampled by ``rows`` (B or 1, H', H) and ``cols`` (B or 1, W', W) in PIL's two passes:
    the horizontal one first (each row resampled along x), each pass's output clipped and rounded to 8 bits."""
    wide = eight_bits(torch.einsum("bchw,bpw->bchp", x, cols.expand(len(x), -1, -1)))
    return eight_bits(torch.einsum("boh,bchp->bcop", rows.expand(len(x), -1, -1), wide))


def pil_bicubic_center_crop(x: torch.Tensor, resize: int, crop: int) -> torch.Tensor:
    """torchvision's Resize(resize, BICUBIC) + CenterCrop(crop) on PIL images: the shorter side to ``resize``, the
    longer to int(resize * long / short), PIL's bicubic filter; then the centre crop."""
    h, w = x.shape[-2:]
    short, long = min(h, w), max(h, w)
    size = (resize, int(resize * long / short))
    new_h, new_w = size if h <= w else size[::-1]
    if (new_h, new_w) != (h, w):  # PIL copies an image already at the size (a 256 px stored square)
        zero = torch.zeros(1, device=x.device)
        x = pil_resize(
            x, pil_weights(zero, zero + h, h, new_h, "bicubic"), pil_weights(zero, zero + w, w, new_w, "bicubic")
        )
    return TF.center_crop(x, [crop, crop])


def eight_bits(x: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] clipped and rounded to 8 bits as PIL stores them (halves up: its fixed-point sums start at
    one half)."""
    return x.mul(255).add_(0.5).floor_().clamp_(0, 255).div_(255)
