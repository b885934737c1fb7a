"""The model entries of `make bench`: every method's real training step, SupSup's class-incremental inference, and
plain timm references on the same device, precision and input size.

- a method (``finetune``, ..., ``l2p``): its first task's phase on a synthetic benchmark, stepped by the loop's own
  :class:`~clbench.loop.step.Stepper` (compiled and replayed as a CUDA graph where the run would be: ``--compile`` and
  ``--cuda-graphs``), with ``before_step`` as the loop calls it;
- ``reference/timm_train``: a plain timm ViT with a classifier, cross-entropy, AdamW (fused on CUDA), eager;
- ``reference/timm_compiled``: the same under ``torch.compile`` (the ceiling a compiled step is held to);
- ``reference/timm_frozen``: a frozen timm ViT, forward and backward to the input (what prompt methods pay);
- ``reference/timm_inference``: one inference-mode forward (L2P's query pass; its target is frozen + inference);
- ``supsup_cil/T=k``: SupSup's class-incremental prediction of one batch after k tasks (one-shot task inference
  through the superposed masks, then the inferred tasks' passes); its peak memory must not grow with k;
- ``finetune_cil/T=k``, ``tuna_cil/T=k``: the same prediction for finetune (one pass) and TUNA (t + 2 passes after
  task t: a pass per task adapter and the universal one), their evaluation time per image side by side.
"""

from __future__ import annotations

import argparse

import torch

from clbench.bench.timing import Entry, Waits, compose
from clbench.methods import BASELINES, TRAINED

METHODS = TRAINED  # every method with a training step
PROMPTS = ("l2p", "dualprompt", "coda_prompt")  # held to L2P's step (frozen backbone, a query pass)
# The rest of the mask survey (issue 25), reported apart from the slowest-method target the CUDA loop was held to:
# APD carries T copies of every block Linear, CTR two capsule plugins a block.
SURVEY = ("apd", "ctr", "ksm", "tfm")
REFERENCES = (
    "reference/timm_train",
    "reference/timm_compiled",
    "reference/timm_frozen",
    "reference/timm_inference",
)
INFERENCE = (
    "supsup_cil/T=2",
    "supsup_cil/T=5",
    "supsup_cil/T=10",
    "finetune_cil/T=5",
    "tuna_cil/T=2",
    "tuna_cil/T=5",
)


def overrides(args: argparse.Namespace, method: str, tasks: int = 1) -> list[str]:
    return [
        f"method={method}",
        f"backbone={args.backbone}",
        f"backbone.img_size={args.image_size}",
        "data=synthetic_tiny",
        f"data.synthetic_classes={2 * tasks}",
        f"data.synthetic_train_per_class={args.batch_size}",
        "data.synthetic_test_per_class=1",
        f"data.tasks={tasks}",
        f"data.synthetic_image_size={args.image_size}",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.device={args.device}",
        f"trainer.precision={args.precision}",
        f"trainer.compile={args.compile}",
        f"trainer.cuda_graphs={args.cuda_graphs}",
        "logger.mode=disabled",
    ]


def method_step(args: argparse.Namespace, name: str, extra: tuple[str, ...] = ()) -> Entry:
    """A method's training step on a fixed batch of the synthetic benchmark, its data part (fetch + augment) and its
    eager twin for FLOP counting. With ``extra`` overrides that stream the data (``finetune/stream``), each step takes
    the next streamed batch and the data part is the time it waited for it."""
    from clbench.loop.optim import build_optimizer, rates_on_device
    from clbench.loop.runtime import build_runtime, replay_rows
    from clbench.loop.step import Stepper, TaskLoss, train_step
    from clbench.loop.task import run_task

    # The baselines step at their second task, where what they add is in play (EWC's penalty, LwF's and BiC's
    # teacher, the memory's replay); the first task is trained for an epoch before it.
    cfg = compose([*overrides(args, name, 2 if name in BASELINES else 1), *extra])
    method, rt = build_runtime(cfg)
    for task in rt.benchmark.tasks:
        method.before_task(task)
        if method.memory is not None:
            method.memory.start_task(task, rt.benchmark.train[task.id].y.cpu())
        if task.id < len(rt.benchmark.tasks) - 1:
            run_task(method, task, rt, epochs=1)
            method.after_task(task)
    trained = [p for p in method.phases(task, 1) if not (p.observe or p.memory)]
    phase = next((p for p in trained if p.name == "train"), trained[0])  # LwF's: after its head-only warm-up
    method.before_phase(task, phase)
    optimizer = build_optimizer(method, task, phase, cfg.trainer, capturable=rt.accel.graphs)
    rates_on_device(optimizer, rt.device)
    stepper = Stepper(method, task, rt, optimizer)
    split = rt.benchmark.train[task.id]
    order = split.permutation()
    method.train()
    batches = split.num_batches(args.batch_size)
    waits = Waits(split, args.batch_size) if extra else None

    ids = order[: args.batch_size] if method.takes_ids() else None  # the batch's positions (recorded teachers)

    def step() -> None:  # what the loop does per batch
        x, y = waits.next() if waits else split.batch(order, 0, args.batch_size)
        method.before_step(task, 0, batches)
        stepper(x, y, ids)

    def eager() -> None:
        x, y = split.batch(order, 0, args.batch_size)
        method.before_step(task, 0, batches)
        model = TaskLoss(method, task)
        replay = bool(method.replay_draws) and method.memory is not None and not method.memory.empty
        train_step(
            method, task, rt, x, y, optimizer=optimizer, params=stepper.params, model=model, ids=ids, replay=replay
        )

    def data() -> None:
        rt.train_tf(split.batch(order, 0, args.batch_size)[0])

    # A replaying method's steps after the first draw from the memory the first filled: they train on more images.
    images = args.batch_size + method.replay_draws * replay_rows(cfg)
    return Entry(step, rt.device, waits or data, eager, images=images)


def inference_step(args: argparse.Namespace, name: str) -> Entry:
    """A method's class-incremental prediction of one batch after T tasks (``<method>_cil/T=<T>``; the tasks walked
    through their lifecycle untrained: SupSup's masks as drawn at their start, TUNA's adapters as initialised)."""
    from clbench.loop.resume import finish_untrained
    from clbench.loop.runtime import build_runtime

    tasks = int(name.rsplit("=", 1)[1])
    method, rt = build_runtime(compose(overrides(args, name.split("_cil/", maxsplit=1)[0], tasks)))
    for task in rt.benchmark.tasks:
        method.before_task(task)
        finish_untrained(method, task)
    method.eval()
    x = rt.test_tf(rt.benchmark.train[0].batch(None, 0, args.batch_size)[0])

    def step() -> None:
        with rt.autocast:
            method.predict(x, None)

    return Entry(step, rt.device)


def reference_step(args: argparse.Namespace, name: str) -> Entry:
    from clbench.backbones import build_backbone
    from clbench.loop.runtime import autocast_for, resolve_device

    cfg = compose(overrides(args, "finetune"))
    device = resolve_device(cfg.trainer.device)
    model = build_backbone(cfg.backbone).to(device)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    autocast = autocast_for(device, cfg.trainer.precision)
    if name in ("reference/timm_train", "reference/timm_compiled"):
        model.reset_classifier(10)
        model.to(device).train()
        fused = {"fused": True} if device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        y = torch.randint(0, 10, (args.batch_size,), device=device)
        forward = torch.compile(model) if name == "reference/timm_compiled" else model

        def train(net: torch.nn.Module) -> None:
            with autocast:
                loss = torch.nn.functional.cross_entropy(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        return Entry(lambda: train(forward), device, flops=lambda: train(model))
    model.requires_grad_(False)
    if name == "reference/timm_inference":
        model.eval()

        def inference() -> None:
            with torch.inference_mode(), autocast:
                model.forward_head(model.forward_features(x), pre_logits=True)

        return Entry(inference, device)
    x.requires_grad_(True)

    def frozen() -> None:
        with autocast:
            out = model.forward_head(model.forward_features(x), pre_logits=True)
        out.float().sum().backward()
        x.grad = None

    return Entry(frozen, device)
