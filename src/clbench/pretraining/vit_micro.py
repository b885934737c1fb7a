"""`make weights` / `python -m clbench.pretraining.vit_micro`: pretrain the micro ViT on stroke glyphs and ship it.

The frozen-backbone methods (L2P, MEAT, Piggyback, SupSup) are meant to run over pretrained features, as in their
papers; no benchmark's data or download may be involved, so the micro ViT (``backbone=vit_micro``, composed from
its YAML) is pretrained with formula-driven supervision (procedural stroke-glyph classes,
:mod:`clbench.pretraining.glyphs`) and written to ``clbench/weights/vit_micro.glyphs.safetensors`` with its
recipe and held-out accuracy in the file's metadata.

Same seed, same thread count, same file, bit for bit: every random draw comes from seeded generators, the
training order is seeded, and torch runs with deterministic algorithms on ``--threads`` CPU threads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from clbench.pretraining.glyphs import render_instances, sample_classes

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
DEFAULT_OUT = WEIGHTS_DIR / "vit_micro.glyphs.safetensors"


def build_micro_vit() -> nn.Module:
    """The architecture of ``backbone=vit_micro`` exactly as a run composes it, randomly initialised."""
    from hydra import compose, initialize_config_dir

    from clbench.backbones import build_backbone
    from clbench.config import config_dir, validate

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = validate(compose("config", overrides=["backbone=vit_micro", "backbone.pretrained=false"]))
    return build_backbone(cfg.backbone)


def render_dataset(args: argparse.Namespace, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Train and held-out instances (uint8 images, labels) of ``args.classes`` glyph classes."""
    classes = sample_classes(gen, args.classes)
    per_class = args.train_per_class + args.test_per_class
    labels = torch.arange(args.classes).repeat(per_class)  # instance-major: every chunk holds every class
    images = torch.cat([render_instances(classes, chunk, gen) for chunk in labels.split(4096)])
    n_train = args.classes * args.train_per_class
    return images[:n_train], labels[:n_train], images[n_train:], labels[n_train:]


@torch.no_grad()
def accuracy(model: nn.Module, head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    batches = zip(x.split(512), y.split(512), strict=True)
    correct = sum(int((head(model(normalize(xb))).argmax(1) == yb).sum()) for xb, yb in batches)
    return 100.0 * correct / len(y)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 -> the micro ViT's input statistics (mean 0.5, std 0.5 per channel, as timm's ViT config)."""
    return (x.float() / 255 - 0.5) / 0.5


def pretrain(args: argparse.Namespace) -> dict[str, str]:
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    x_tr, y_tr, x_te, y_te = render_dataset(args, gen)
    rendered = time.perf_counter() - start
    print(f"rendered {len(y_tr)} train and {len(y_te)} held-out images of {args.classes} classes in {rendered:.0f} s")

    model = build_micro_vit()
    head = nn.Linear(model.num_features, args.classes)
    params = [*model.parameters(), *head.parameters()]
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    per_epoch = len(y_tr) // args.batch_size
    total, warmup = args.epochs * per_epoch, per_epoch

    def lr_factor(s: int) -> float:  # one warm-up epoch, then cosine to 0
        return (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(y_tr), generator=gen)
        running = 0.0
        for b in range(per_epoch):
            idx = order[b * args.batch_size : (b + 1) * args.batch_size]
            x = normalize(x_tr[idx])
            flip = torch.rand(len(idx), generator=gen) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            loss = F.cross_entropy(head(model(x)), y_tr[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            schedule.step()
            running += float(loss.detach())
        held_out = accuracy(model, head, x_te, y_te)
        elapsed = time.perf_counter() - start
        loss = running / per_epoch
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss:.3f}, held-out acc {held_out:.1f}% ({elapsed:.0f} s)")

    train_acc = accuracy(model, head, x_tr[: len(y_te)], y_tr[: len(y_te)])
    recipe = {k: v for k, v in vars(args).items() if k != "out"}
    meta = {
        "source": "procedural stroke-glyph classes (clbench.pretraining.glyphs), no natural images",
        "recipe": recipe,
        "command": "make weights",
        "held_out_acc": f"{held_out:.2f}",
        "train_acc": f"{train_acc:.2f}",
        "chance_acc": f"{100 / args.classes:.2f}",
        "torch": torch.__version__,
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One metadata entry: safetensors writes its metadata map in no fixed order, a JSON string sorted by key is.
    save_file(state, str(args.out), metadata={"clbench": json.dumps(meta, sort_keys=True)})
    meta["sha256"] = hashlib.sha256(args.out.read_bytes()).hexdigest()  # the file holds no clock: same seed, same bytes
    meta["seconds"] = f"{time.perf_counter() - start:.0f}"
    return meta


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write the weights (default: {DEFAULT_OUT})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--classes", type=int, default=64, help="glyph classes")
    p.add_argument("--train-per-class", type=int, default=500)
    p.add_argument("--test-per-class", type=int, default=50, help="held-out instances per class")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (part of what makes the file bit-identical)")
    return p


def main() -> None:
    meta = pretrain(parser().parse_args())
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
