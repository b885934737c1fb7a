"""Formula-driven stroke glyphs: procedural classes of pen strokes for supervised pretraining without natural images.

In the spirit of formula-driven supervised learning (FractalDB: Kataoka et al., ACCV 2020; contour databases:
Kataoka et al., CVPR 2022; "Can Vision Transformers Learn without Natural Images?", Nakashima et al., AAAI 2022),
a class is a formula and its images are renderings of it: here 1 to 3 cubic Bezier strokes with random control
points in [-1, 1]^2. An instance moves every control point by N(0, ``jitter``), rotates (+-15 degrees), scales and
shifts the glyph, draws it with a random pen width in light ink on a dark ground (both randomly tinted), and may
render it at a lower resolution and upsample it (soft strokes, as in small-image benchmarks). No image of any
benchmark is involved.

Why strokes rather than IFS fractals: on this CPU budget a micro ViT trained on 64 FractalDB-style IFS classes at
32 px stayed at chance after a full epoch (2.1% held-out, chance 1.6%); on stroke classes it leaves chance within
the first epoch (figures in the README). Random ink and ground colours per image kept it at chance too (16
classes, 100 steps): the tint is now mild, so that the strokes, not the colours, carry the class.
Every draw comes from one ``torch.Generator``: same seed, same images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CURVE_SAMPLES = 48  # points per stroke at which the pen's distance is measured


def sample_classes(gen: torch.Generator, num_classes: int, max_strokes: int = 3) -> list[torch.Tensor]:
    """Per class, the control points (strokes, 4, 2) of 1..``max_strokes`` cubic Bezier strokes in [-1, 1]^2."""
    return [
        torch.rand(int(torch.randint(1, max_strokes + 1, (1,), generator=gen)), 4, 2, generator=gen) * 2 - 1
        for _ in range(num_classes)
    ]


def bezier(control: torch.Tensor, samples: int = CURVE_SAMPLES) -> torch.Tensor:
    """Points (..., samples, 2) along cubic Bezier curves with control points (..., 4, 2)."""
    t = torch.linspace(0, 1, samples, dtype=control.dtype)[:, None]
    basis = torch.cat([(1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3], dim=1)  # (samples, 4)
    return basis @ control


def render_instances(
    classes: list[torch.Tensor], labels: torch.Tensor, gen: torch.Generator, size: int = 32, jitter: float = 0.08
) -> torch.Tensor:
    """uint8 RGB images (B, 3, size, size), one random instance of class ``labels[i]`` each."""
    b, most = len(labels), max(len(c) for c in classes)
    control = torch.zeros(b, most, 4, 2)
    present = torch.zeros(b, most, dtype=torch.bool)
    for i, c in enumerate(labels.tolist()):
        control[i, : len(classes[c])] = classes[c]
        present[i, : len(classes[c])] = True
    control = control + jitter * torch.randn(control.shape, generator=gen)
    angle = (torch.rand(b, generator=gen) - 0.5) * (math.pi / 6)
    c, s = angle.cos(), angle.sin()
    rotation = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)  # (B, 2, 2)
    scale = 0.55 + 0.3 * torch.rand(b, 1, 1, generator=gen)
    shift = 0.15 * (torch.rand(b, 1, 2, generator=gen) * 2 - 1)
    points = bezier(control).flatten(1, 2)  # (B, strokes * samples, 2)
    points = points @ rotation.transpose(1, 2) * scale + shift
    far = torch.full_like(points, 1e3)
    points = torch.where(present.repeat_interleave(CURVE_SAMPLES, 1)[..., None], points, far)  # absent strokes
    axis = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 2 - 1
    grid = torch.stack(torch.meshgrid(axis, axis, indexing="xy"), -1).view(1, -1, 2).expand(b, -1, -1)
    distance = torch.cdist(grid, points).amin(-1).view(b, size, size) * (size / 2)  # in pixels
    width = 0.6 + 1.2 * torch.rand(b, 1, 1, generator=gen)
    cover = (width + 0.5 - distance).clamp(0, 1)  # anti-aliased pen of half-width ``width`` px
    low = torch.randint(8, 2 * size, (b,), generator=gen).clamp_max(size)  # half the images at full resolution
    cover = torch.stack(
        [
            F.interpolate(F.interpolate(m[None, None], size=int(r), mode="area"), size=size, mode="bilinear")[0, 0]
            if r < size
            else m
            for m, r in zip(cover, low, strict=True)
        ]
    )
    # Light ink on a dark ground, each slightly tinted: the strokes, not the colours, tell the classes apart.
    ink = 0.7 + 0.3 * torch.rand(b, 1, 1, 1, generator=gen) + 0.1 * (torch.rand(b, 3, 1, 1, generator=gen) - 0.5)
    ground = 0.3 * torch.rand(b, 1, 1, 1, generator=gen) + 0.1 * (torch.rand(b, 3, 1, 1, generator=gen) - 0.5)
    image = (ground + (ink - ground) * cover[:, None]).clamp(0, 1)
    return (image * 255).round().clamp(0, 255).to(torch.uint8)
