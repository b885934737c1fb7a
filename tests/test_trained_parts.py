"""Every run says which parameters train, by part: checked against what each method's paper trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from clbench.backbones import build_backbone
from clbench.loop import train
from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import build_runtime
from clbench.loop.trained_parts import backbone_parts, parameter_parts, trained_counts
from conftest import tiny_config

BACKBONE = ("block weights", "embeddings", "norms")


def test_a_vits_parameters_fall_into_blocks_embeddings_and_norms() -> None:
    vit = build_backbone(tiny_config("backbone.kwargs.depth=2").backbone)
    parts = backbone_parts(vit)
    numel = {n: p.numel() for n, p in vit.named_parameters()}
    embeddings = vit.pos_embed.numel() + vit.cls_token.numel() + sum(p.numel() for p in vit.patch_embed.parameters())
    norms = sum(p.numel() for m in vit.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters())
    linears = sum(
        p.numel() for b in vit.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc1, b.mlp.fc2) for p in m.parameters()
    )
    by_part = {part: sum(numel[n] for n, q in parts.items() if q == part) for part in BACKBONE}
    assert by_part == {"block weights": linears, "embeddings": embeddings, "norms": norms}


def first_phase_counts(*overrides: str, phase: int = 0) -> dict[str, int]:
    """What the first task's phase ``phase`` hands its optimizer, by part."""
    cfg = tiny_config(*overrides)
    method, rt = build_runtime(cfg)
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    trainable = [p for p in method.phases(task, cfg.trainer.epochs) if p.epochs and not p.observe and not p.memory]
    optimizer = build_optimizer(method, task, trainable[phase], cfg.trainer)
    return trained_counts(optimizer, parameter_parts(method, rt.backbone_parts))


@pytest.mark.parametrize(
    ("overrides", "trained"),
    [
        (("method=finetune",), {*BACKBONE, "heads"}),  # the whole ViT and the head
        (("method=individual",), {*BACKBONE, "heads"}),  # a fine-tuned copy of the ViT a task
        (("method=classifier",), {"heads"}),  # a head on the frozen ViT
        (("method=lwf",), {"heads"}),  # LwF's warm-up: the new head alone
        (("method=meat",), {"heads", "method's own"}),  # masks over the frozen ViT
        (("method=piggyback",), {"heads", "method's own"}),
        (("method=l2p",), {"heads", "method's own"}),  # prompts and keys, frozen ViT
        (("method=adapter",), {"heads", "method's own"}),  # adapters and their LayerNorms, frozen ViT
    ],
)
def test_each_method_trains_the_parts_its_paper_trains(overrides: tuple[str, ...], trained: set[str]) -> None:
    counts = first_phase_counts(*overrides)
    assert {part for part, n in counts.items() if n} == trained


def test_a_run_says_what_each_phase_trains_and_records_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config("method=lwf", "data.num_tasks=2", "trainer.epochs=1", "trainer.eval_random_init=false")
    method, _ = build_runtime(cfg)
    backbone = sum(p.numel() for p in method.backbone.parameters())
    train(cfg, tmp_path)
    entries = json.loads((tmp_path / "results.json").read_text())["trained_parameters"]
    assert [(e["task"], e["phase"]) for e in entries] == [(0, "warmup"), (0, "train"), (1, "warmup"), (1, "train")]
    head = 2 * cfg.backbone.kwargs["embed_dim"] + 2  # a 2-class linear head
    assert [e["heads"] for e in entries] == [head, head, head, 2 * head]  # task 1 distils through the old head too
    assert sum(entries[1][part] for part in BACKBONE) == backbone and entries[0]["block weights"] == 0
    said = " ".join(capsys.readouterr().err.split())  # as printed, less the terminal's line breaks
    assert "task 0, phase warmup: trains heads 66; frozen: block weights, embeddings, norms, method's own" in said
