"""The rehearsal memory (clbench.memory) and the methods that replay from it (ER, DER++, L2P-R).

The samplers are checked against transcriptions of their reference rules (BASELINES.md §2.2: mammoth's reservoir,
L2P's first-epoch subset), written here as plain sequential loops; the methods' losses against their equations on
fixed tensors; the loop's use of the memory by runs: a resumed run ends as an uninterrupted one, a streamed run as one
held on the device, two gloo ranks as one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clbench.config import MemoryConfig
from clbench.data import Task
from clbench.errors import ConfigError
from clbench.loop import train
from clbench.loop.runtime import build_runtime
from clbench.memory import Memory
from clbench.methods.base import Replay
from conftest import TINY, clbench, crash_and_resume, said, tiny_config, torchrun

TASK = Task(0, (0, 1), ("a", "b"), 0)


def memory(size: int, sampler: str = "reservoir", per_class: int | None = None, logits: bool = False) -> Memory:
    config = MemoryConfig(size=None if per_class else size, per_class=per_class)
    return Memory(config, sampler, num_classes=4, image_shape=(1, 2, 2), logits=logits)


def reservoir_reference(capacity: int, stream: list[int], uniforms: list[float]) -> list[int | None]:
    """mammoth utils/buffer.py ``reservoir`` + ``add_data``, one item at a time: item n (0-based count of the items
    seen before it) takes slot n while n < capacity, else slot floor(u * (n + 1)) if that is < capacity."""
    slots: list[int | None] = [None] * capacity
    for n, (item, u) in enumerate(zip(stream, uniforms, strict=True)):
        j = n if n < capacity else int(u * (n + 1))
        if j < capacity:
            slots[j] = item
    return slots


def images_of(items: list[int]) -> torch.Tensor:
    return torch.tensor(items, dtype=torch.uint8)[:, None, None, None].expand(-1, 1, 2, 2).contiguous()


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_the_vectorised_reservoir_is_the_sequential_rule(batch: int) -> None:
    """Batches of any size give what one-at-a-time insertion gives with the same uniforms; two items of one batch
    that draw the same slot resolve to the later one."""
    mem, stream = memory(5), list(range(1, 41))
    uniforms: list[float] = []
    for lo in range(0, len(stream), batch):
        items = stream[lo : lo + batch]
        torch.manual_seed(lo)
        uniforms += torch.rand(len(items), dtype=torch.float64).tolist()
        torch.manual_seed(lo)
        mem.insert(images_of(items), torch.tensor(items) % 4, 0)
    expected = reservoir_reference(5, stream, uniforms)
    assert mem.images[:5, 0, 0, 0].tolist() == expected
    assert mem.labels[:5].tolist() == [i % 4 for i in expected]
    assert int(mem.offered) == len(stream)


def test_the_reservoir_keeps_each_item_with_probability_capacity_over_n() -> None:
    kept = torch.zeros(40)
    torch.manual_seed(0)
    for _ in range(400):
        mem = memory(10)
        mem.insert(images_of(list(range(40))), torch.zeros(40, dtype=torch.long), 0)
        kept[mem.images[:10, 0, 0, 0].long()] += 1
    assert abs(kept.mean().item() / 400 - 10 / 40) < 1e-6  # exactly 10 kept each time
    assert (kept / 400 - 0.25).abs().max() < 0.09  # each item near 1/4 (binomial std 0.022)


def test_the_first_items_fill_the_slots_in_order_and_draws_are_distinct_held_slots() -> None:
    mem = memory(8, logits=True)
    mem.insert(images_of([10, 11, 12]), torch.tensor([0, 1, 2]), 0, logits=torch.ones(3, 2))
    mem.offer_counted(3)
    assert mem.images[:3, 0, 0, 0].tolist() == [10, 11, 12] and mem.labels[3:8].tolist() == [-1] * 5
    assert mem.width[:3].tolist() == [2, 2, 2] and mem.logits[:3, 2:].abs().sum() == 0
    assert sorted(mem.draw(3).tolist()) == [0, 1, 2]  # without replacement while enough is held
    assert set(mem.draw(7).tolist()) <= {0, 1, 2}  # with replacement beyond that, never an empty slot
    assert mem.storage() | {"per_class_counts": None} == {
        "sampler": "reservoir",
        "capacity": 8,
        "view": "raw",
        "held_in": "cpu",
        "samples": 3,
        "bytes_images": 12,
        "bytes_labels": 24,
        "bytes_task_ids": 24,
        "bytes_logits": 48,
        "per_class_counts": None,
        "validation_samples": 0,
    }


def test_the_uniform_sampler_stores_l2ps_chosen_positions_of_each_tasks_first_epoch() -> None:
    """L2P's buffer (libml/continual_buffer.py ``gen_batch_index`` / ``add_example``): per task, per_class x its classes
    distinct positions drawn uniformly from the first ⌊N / B⌋ x B of its stream (the first epoch's full batches), each
    image stored as its position comes, in stream order, a later task's into its own slots; the host counts what is
    stored. Over seeds every such position is equally likely, the last partial batch's never."""
    batch, n, seeds = 4, 14, 300  # 3 full batches (12 positions) and a partial one of 2
    counts = [0] * n
    labels = torch.tensor([0, 1] * 7)
    for seed in range(seeds):
        torch.manual_seed(seed)
        config = MemoryConfig(per_class=2)
        mem = Memory(config, "uniform", num_classes=4, image_shape=(1, 2, 2), batch_size=batch, longest_task=n)
        mem.start_task(TASK, labels)
        for epoch in range(2):  # the second epoch's images (100 + position) must never enter
            for lo in range(0, n, batch):
                items = [epoch * 100 + i for i in range(lo, min(lo + batch, n))]
                mem.insert(images_of(items), labels[lo : lo + batch], 0)
                mem.offer_counted(len(items))
                assert mem.held == int((mem.labels[:4] >= 0).sum())
        kept = mem.images[:4, 0, 0, 0].tolist()
        assert kept == sorted(kept) and len(set(kept)) == 4 and max(kept) < 12, kept
        for k in kept:
            counts[k] += 1
    p = 4 / 12
    tolerance = 5 * (seeds * p * (1 - p)) ** 0.5
    assert all(abs(c - seeds * p) < tolerance for c in counts[:12]), counts
    assert counts[12:] == [0, 0]
    mem.start_task(Task(1, (2, 3), ("c", "d"), 2), torch.tensor([2, 3] * 4))
    mem.insert(images_of([40, 41, 42, 43]), torch.tensor([2, 3, 2, 3]), 1)
    mem.insert(images_of([44, 45, 46, 47]), torch.tensor([2, 3, 2, 3]), 1)
    second = mem.images[4:8, 0, 0, 0].tolist()
    assert mem.images[:4, 0, 0, 0].tolist() == kept
    assert second == sorted(second) and len(set(second)) == 4 and set(second) <= set(range(40, 48))
    assert mem.tasks[:8].tolist() == [0] * 4 + [1] * 4


def test_the_uniform_sampler_draws_with_replacement_while_it_holds_less_than_a_draw() -> None:
    """L2P's ``get_random_batch``: ``replace = cursor < global_bs``: every row with replacement (the first rows not
    all distinct), once it holds enough none repeats."""
    mem = memory(0, "uniform", per_class=2)
    mem.slot_of = torch.arange(4)  # the first 4 positions of the task are its 4 slots
    mem.insert(images_of([10, 11, 12, 13]), torch.tensor([0, 1, 0, 1]), 0)
    torch.manual_seed(0)
    distinct = sum(len(set(mem.draw(8)[:4].tolist())) == 4 for _ in range(400))
    assert abs(distinct / 400 - 24 / 256) < 0.05  # 4! / 4^4 of draws with replacement start with 4 distinct slots
    assert all(sorted(mem.draw(4).tolist()) == [0, 1, 2, 3] for _ in range(20))


def test_the_balanced_sampler_shrinks_old_classes_to_an_equal_share() -> None:
    mem = memory(6, "balanced")
    labels = torch.tensor([0, 1] * 5)
    plan = mem.plan(TASK, labels)
    mem.write(plan, images_of(plan.rows()), labels[plan.rows()], 0, first=0)
    assert mem.storage()["per_class_counts"] == [3, 3, 0, 0]
    second = Task(1, (2, 3), ("c", "d"), 2)
    labels = torch.tensor([2, 3] * 5)
    plan = mem.plan(second, labels)
    mem.write(plan, images_of([100 + r for r in plan.rows()]), labels[plan.rows()], 1, first=10)
    assert mem.storage()["per_class_counts"] == [1, 1, 1, 1]  # iCaRL's m = 6 // 4 classes each; 2 slots stay free
    assert set(mem.images[:6][mem.labels[:6] >= 2, 0, 0, 0].tolist()) <= {100 + r for r in plan.rows()}
    # each slot knows where its image came from: task 0's row r is the training data's image r, task 1's row r
    # (stored as 100 + r) its image 10 + r (task 0 has 10)
    held = mem.labels[:6] >= 0
    images = mem.images[:6][held, 0, 0, 0].long()
    assert torch.equal(mem.source[:6][held], torch.where(images >= 100, images - 100 + 10, images))


def test_a_memory_is_refused_where_it_cannot_serve() -> None:
    with pytest.raises(ConfigError, match=r"memory.per_class.*no use for a rehearsal memory"):
        tiny_config("method=meat", "memory.per_class=5")
    with pytest.raises(ConfigError, match=r"memory.per_class.*needs a budget"):
        tiny_config("method=er", "memory.per_class=null")
    with pytest.raises(ConfigError, match=r"memory.sampler.*logits it replays"):
        tiny_config("method=derpp", "memory.sampler=balanced")
    with pytest.raises(ConfigError, match=r"memory.size.*not both"):
        tiny_config("method=er", "memory.size=100")
    with pytest.raises(ConfigError, match=r"memory.sampler"):
        tiny_config("method=er", "memory.sampler=fifo")


def built(*overrides: str):
    torch.manual_seed(0)
    method, rt = build_runtime(tiny_config(*overrides))
    method.before_task(rt.benchmark.tasks[0])
    method.before_task(rt.benchmark.tasks[1])
    return method, rt


def test_er_loss_is_the_mean_over_current_and_memory_rows() -> None:
    """Not the mean of the two means: 5 current rows and 3 memory rows weigh 5:3."""
    method, rt = built("method=er")
    task = rt.benchmark.tasks[1]
    x, y = torch.randn(5, 3, 16, 16), torch.tensor([2, 3, 2, 3, 2])
    mx, my = torch.randn(3, 3, 16, 16), torch.tensor([0, 1, 0])
    loss, _ = method.training_loss(x, y, task, replay=(Replay(mx, my),))
    logits = method.seen_logits(method.features(torch.cat([x, mx]), None))
    expected = F.cross_entropy(logits, torch.cat([y, my]))
    torch.testing.assert_close(loss, expected)


def test_derpp_loss_is_its_three_terms_with_the_mse_over_the_stored_width() -> None:
    """Eq. 6: CE(x, y) + alpha MSE(f(x1), z1) + beta CE(f(x2), y2); a logit stored while 2 classes were seen is
    compared on those 2 only; the current rows' logits are kept for the reservoir."""
    method, rt = built("method=derpp", "method.alpha=0.3", "method.beta=0.7")
    task = rt.benchmark.tasks[1]
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([2, 3, 2, 3])
    x1, x2 = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
    z1 = torch.tensor([[1.0, -1.0, 0.0, 0.0, 0, 0], [0.5, 0.2, 0.3, -0.4, 0, 0]])
    width = torch.tensor([2, 4])
    y2 = torch.tensor([1, 0])
    replay = (Replay(x1, torch.tensor([0, 1]), z1, width), Replay(x2, y2, z1, width))
    loss, _ = method.training_loss(x, y, task, replay=replay)
    out = lambda images: method.seen_logits(method.features(images, None))  # noqa: E731
    f1 = out(x1)
    squares = [((f1[0, :2] - z1[0, :2]) ** 2).tolist(), ((f1[1, :4] - z1[1, :4]) ** 2).tolist()]
    mse = (sum(squares[0]) / 2 + sum(squares[1]) / 4) / 2  # each row over its width, then the mean of the rows
    expected = F.cross_entropy(out(x), y) + 0.3 * mse + 0.7 * F.cross_entropy(out(x2), y2)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(method.stored_logits, out(x))


def matrices(path: Path) -> dict:
    res = json.loads((path / "results.json").read_text())
    return {k: res.get(k) for k in ("acc_matrix", "before_task_acc", "random_init_acc", "status", "storage")}


@pytest.mark.parametrize(
    "overrides",
    [
        ("method=er",),
        pytest.param(("method=derpp",), marks=pytest.mark.slow),
        pytest.param(("method=l2p", "memory.per_class=4", "trainer.epochs=3"), marks=pytest.mark.slow),
    ],
)
def test_a_run_resumed_mid_task_ends_as_the_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...]
) -> None:
    """The memory (its slots, counters and the generator behind its draws) is in the checkpoint: stopped in task 1,
    with a memory to replay, the resumed run draws what the uninterrupted one drew."""
    overrides = (*overrides, "trainer.checkpoint_every=1")
    train(tiny_config(*overrides), tmp_path / "whole")
    expected = matrices(tmp_path / "whole")
    assert expected["storage"]["memory"]["samples"] > 0
    crash_and_resume(monkeypatch, overrides, tmp_path / "cut", 7)  # task 1, its second epoch (3 batches an epoch)
    assert matrices(tmp_path / "cut") == expected


def test_the_official_l2p_r_resumed_mid_task_ends_as_the_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2P-R as its code: the stored augmented views, the chosen first-epoch positions and the host's count of them,
    the whole head: stopped in task 1's second epoch (4 steps an epoch), the resumed run replays what the whole one
    did."""
    overrides = (
        "method=l2p",
        "memory.per_class=4",
        "memory.view=augmented",
        "method.replay_scope=all",
        "method.replay_first_task=false",
        "data.train_crop=pad",
        "trainer.checkpoint_every=1",
    )
    train(tiny_config(*overrides), tmp_path / "whole")
    expected = matrices(tmp_path / "whole")
    assert expected["storage"]["memory"]["samples"] == 24 and expected["storage"]["memory"]["view"] == "augmented"
    crash_and_resume(monkeypatch, overrides, tmp_path / "cut", 14)
    assert matrices(tmp_path / "cut") == expected


@pytest.mark.parametrize(
    "overrides",
    [
        ("method=derpp",),
        ("method=bic", "memory.size=null", "memory.per_class=4", "method.bias_epochs=1", "trainer.epochs=2"),
    ],
)
def test_a_streamed_run_replays_what_a_run_held_on_the_device_replays(
    tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    """DER++ replays in the step; BiC's first stage streams the memory's images from the cache with the task's (read
    from where each came from): both give the device store's numbers."""
    train(tiny_config(*overrides), tmp_path / "device")
    stream = ("data.store=stream", "data.stream_workers=0", f"data.cache_dir={tmp_path / 'cache'}")
    train(tiny_config(*overrides, *stream), tmp_path / "stream")
    assert matrices(tmp_path / "stream") == matrices(tmp_path / "device")


@pytest.mark.slow  # two gloo processes, twice: 40 s
def test_two_gloo_ranks_keep_one_memory(tmp_path: Path) -> None:
    """Every rank inserts the whole global batch (a streaming rank completes the rows it did not read; DER++'s logits
    are gathered): the memory, and so the run, is the single process's."""
    overrides = (*TINY, "method=derpp", "trainer.batch_size=16", "logger.mode=disabled")
    stream = ("data.store=stream", f"data.cache_dir={tmp_path / 'cache'}", "data.stream_workers=1")
    one = clbench(*overrides, f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    for name, extra in (("two", ()), ("two_streamed", stream)):
        out = torchrun(2, *overrides, *extra, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert out.returncode == 0, said(out)
    a, b, c = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two", "two_streamed"))
    assert a["storage"]["memory"] == b["storage"]["memory"] == c["storage"]["memory"]
    for s in ("til", "cil"):  # one test image of a 20-image task (5 points) for summation order
        for rows in zip(a["acc_matrix"][s], b["acc_matrix"][s], c["acc_matrix"][s], strict=True):
            assert all(max(v) - min(v) <= 5.0 for v in zip(*rows, strict=True) if v[0] is not None)


@pytest.mark.parametrize("overrides", [("method=er",), ("method=derpp",), ("method=l2p", "memory.per_class=10")])
def test_a_replaying_loss_compiles_as_one_graph(overrides: tuple[str, ...]) -> None:
    """The memory batches enter ``training_loss`` as tensors (DER++ keeps its current logits on the module): one
    graph, no break, so the replaying step compiles and captures as the others do."""
    from clbench.loop.step import draw_replay

    method, rt = build_runtime(tiny_config(*overrides))
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    method.memory.start_task(task, torch.zeros(100, dtype=torch.long))
    x, y = rt.benchmark.train[0].batch(None, 0, 8)
    method.memory.insert(x, y, 0, torch.zeros(8, 2) if method.memory.keeps_logits else None)
    method.memory.offer_counted(8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(method.training_loss)(rt.train_tf(x), y, task, replay=draw_replay(method, rt, 8))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_held_out_validation_images_never_reach_training_and_are_all_the_bias_stage_sees() -> None:
    """BiC's split (⌊0.1 · share⌋ a class, at least one): a new class's validation images are drawn at the task's
    start and left out of every training phase's data; the bias stage (before the memory update) sees them, and
    afterwards the memory keeps them apart from its training images."""
    from clbench.data import Split
    from clbench.loop.task import phase_data
    from clbench.methods.base import Phase

    config = MemoryConfig(per_class=10)
    mem = Memory(config, "balanced", num_classes=4, image_shape=(1, 2, 2), holdout=0.1)
    labels = torch.tensor([0, 1] * 20)
    torch.manual_seed(0)
    mem.start_task(TASK, labels)
    assert len(mem.held_out) == 2 and sorted(labels[mem.held_out].tolist()) == [0, 1]

    class Owner:
        memory = mem

    split = Split(images_of(list(range(40))), labels)
    trained = phase_data(Owner, Phase("train", 1), split)  # type: ignore[arg-type]
    assert len(trained) == 38 and not set(trained.x[:, 0, 0, 0].tolist()) & set(mem.held_out)
    plan = mem.plan(TASK, labels)
    mem.write(plan, images_of(plan.rows()), labels[plan.rows()], 0, first=0)
    validation = phase_data(Owner, Phase("bias", 1, data="validation"), split)  # type: ignore[arg-type]
    assert sorted(validation.x[:, 0, 0, 0].tolist()) == sorted(mem.held_out)  # now the memory's, read once
    memory_part = phase_data(Owner, Phase("fit", 1, data="memory"), split)  # type: ignore[arg-type]
    assert len(memory_part) == 18 and not set(memory_part.x[:, 0, 0, 0].tolist()) & set(mem.held_out)
    assert mem.storage()["validation_samples"] == 2
    second = Task(1, (2, 3), ("c", "d"), 2)
    labels2 = torch.tensor([2, 3] * 20)
    mem.start_task(second, labels2)
    split2 = Split(images_of(list(range(100, 140))), labels2)
    before_update = phase_data(Owner, Phase("bias", 1, data="validation"), split2)  # type: ignore[arg-type]
    assert sorted(before_update.y.tolist()) == [0, 1, 2, 3]  # the old classes' from the memory, the new ones' held out
    old_validation = set(validation.x[:, 0, 0, 0].tolist())
    assert set(before_update.x[:, 0, 0, 0].tolist()) == old_validation | {100 + r for r in mem.held_out}


# ----------------------------------------------------------------------------- budgets refused before any work
@pytest.mark.parametrize("method", ["er", "derpp", "gdumb", "bic"])
def test_memory_none_drops_the_budget_a_method_sets_and_a_replaying_method_refuses_to_run(method: str) -> None:
    """`memory=none` means no memory whatever the method's YAML or a preset sets (it used to be ignored: the YAML's 20
    images a class came after it); a method that replays then refuses to run, naming the budget it needs."""
    with pytest.raises(ConfigError, match=r"`memory\.per_class`: None.*needs a budget.*memory=none"):
        tiny_config(f"method={method}", "memory=none")
    budget = "memory.size=30" if method == "bic" else "memory.per_class=3"  # BiC's code budgets a total
    cfg = tiny_config(f"method={method}", "memory=none", budget)
    assert (cfg.memory.size, cfg.memory.per_class) == ((30, None) if method == "bic" else (None, 3))
    own = tiny_config(f"method={method}").memory  # the method's own budget by default
    assert (own.size, own.per_class) == ((200, None) if method == "bic" else (None, 20))


def test_memory_none_gives_a_preset_that_can_run_without_a_memory_none() -> None:
    cfg = tiny_config("experiment=l2p_table1_l2p_r_10", "memory=none")
    assert not cfg.memory.active and cfg.method_target.endswith("L2P")


def refused_at_build(key: str, value: object, limit: str, *overrides: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`: {value}\. Allowed: {limit}"):
        build_runtime(tiny_config(*overrides))


def test_budgets_the_samplers_cannot_keep_are_refused_with_the_limit() -> None:
    """Each limit from the rules: a class keeps per_class (or size // classes seen) images, at least one; BiC holds
    ⌊0.1 x share⌋ of them, at least one, out for its bias stage and trains on ⌈share⌉ - ⌈0.1 x share⌉ (its code's
    counts, at most ⌊share⌋ less the held-out ones), so it needs a share of 2, and a new class holds ⌊0.1 x share⌋ of
    its training images out, fewer than it has: share < 10 x the smallest class."""
    sizes = [
        [int(n) for n in torch.bincount(split.y).tolist() if n]
        for split in build_runtime(tiny_config())[1].benchmark.train
    ]
    classes, smallest = sum(map(len, sizes)), min(min(s) for s in sizes)
    refused_at_build("memory.per_class", 1, "at least 2 ", "method=bic", "memory.size=null", "memory.per_class=1")
    refused_at_build(
        "memory.size", 5, f"at least {2 * classes} ", "method=bic", "memory.per_class=null", "memory.size=5"
    )
    big = 10 * smallest + 5
    refused_at_build(
        "memory.per_class",
        big,
        f"at most {10 * smallest - 1} ",
        "method=bic",
        "memory.size=null",
        f"memory.per_class={big}",
    )
    refused_at_build(
        "memory.size", 3, f"at least {classes} ", "method=er", "memory.sampler=balanced", "memory.per_class=null",
        "memory.size=3",
    )  # fmt: skip
    build_runtime(
        tiny_config("method=bic", "memory.size=null", "memory.per_class=2")
    )  # the limits themselves are accepted
    build_runtime(tiny_config("method=bic", "memory.size=null", f"memory.per_class={10 * smallest - 1}"))


def slot_bytes(memory: Memory) -> int:
    """The bytes of a built memory's buffers that hold a row per slot (its scratch row included)."""
    rows = memory.capacity + 1
    return sum(b.numel() * b.element_size() for b in memory.buffers() if b.dim() and len(b) == rows)


def test_a_memory_or_a_replay_that_cannot_be_allocated_is_refused_before_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Against the free memory where the memory is held (here the host, said to have 1 MiB free): the limit is what
    the memory's own buffers take a slot (measured on a built memory), and a replayed image its uint8 copy plus its
    fp32 input at the backbone's size."""
    from clbench.loop import runtime

    free = 2**20
    monkeypatch.setattr(runtime, "free_memory", lambda device: free)
    method, rt = build_runtime(tiny_config("method=derpp", "memory.per_class=1"))
    assert method.memory is not None
    per_slot = slot_bytes(method.memory) // (method.memory.capacity + 1)
    classes = rt.benchmark.num_classes
    refused_at_build(
        "memory.per_class", 1000000000, f"at most {(free // per_slot - 1) // classes} here", "method=derpp",
        "memory.per_class=1000000000",
    )  # fmt: skip
    refused_at_build(
        "memory.size", 100000000000, f"at most {free // per_slot - 1} here", "method=derpp", "memory.per_class=null",
        "memory.size=100000000000",
    )  # fmt: skip
    image = rt.benchmark.train[0].x[0]
    per_image = image.numel() + 3 * rt.cfg.backbone.img_size**2 * 4
    er, _ = build_runtime(tiny_config("method=er", "memory.per_class=1"))
    assert er.memory is not None
    left = free - slot_bytes(er.memory)
    refused_at_build(
        "memory.batch_size", 1000000000, f"at most {left // per_image} here", "method=er", "memory.per_class=1",
        "memory.batch_size=1000000000",
    )  # fmt: skip
