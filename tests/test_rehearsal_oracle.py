"""The reservoir memory, ER and DER++ against independent transcriptions of their rules
(tests/oracles/rehearsal_reference.py; BASELINES.md §2.2(a), §2.3, §6, §7 and the §14 checklist). Only the public API
is used: ``Memory.insert / offer_counted / draw`` and its buffers, ``Method.training_loss`` with ``Replay`` batches."""

from __future__ import annotations

import math

import pytest
import torch

from clbench.config import MemoryConfig
from clbench.loop.runtime import build_runtime
from clbench.memory import Memory
from clbench.methods.base import Replay
from conftest import tiny_config
from oracles import rehearsal_reference as ref

K = 6  # classes of the tiny benchmark (3 tasks of 2)
SHAPE = (1, 2, 2)  # tiny images; every pixel of item i holds i (uint8), so a slot's image names its item


# ------------------------------------------------------------------------------------------------------ reservoir
def new_memory(size: int, logits: bool = False) -> Memory:
    return Memory(MemoryConfig(size=size), "reservoir", num_classes=K, image_shape=SHAPE, logits=logits)


def item_logits(index: int, width: int) -> list[float]:
    """Distinct logits for item ``index`` (``width`` valid columns)."""
    return [index + 0.125 * (c + 1) for c in range(width)]


def offer(memory: Memory, start: int, n: int, seed: int, width: int | None) -> list[float]:
    """Offer items start..start+n-1 under torch seed ``seed``; returns the uniforms the insert consumed."""
    torch.manual_seed(seed)
    uniforms = torch.rand(n, dtype=torch.float64).tolist()
    index = torch.arange(start, start + n)
    images = index.to(torch.uint8).view(n, 1, 1, 1).expand(n, *SHAPE).contiguous()
    labels = index % K
    logits = None if width is None else torch.tensor([item_logits(i, width) for i in range(start, start + n)])
    torch.manual_seed(seed)
    memory.insert(images, labels, task_id=start // 10, logits=logits)
    memory.offer_counted(n)
    return uniforms


def assert_state(memory: Memory, slots: list, capacity: int, with_logits: bool) -> None:
    """``slots[k]``: None (empty) or ``(item, width)``; the memory's first ``capacity`` rows must hold exactly that."""
    labels = memory.labels[:capacity].tolist()
    images = memory.images[:capacity].tolist()
    for k, entry in enumerate(slots):
        if entry is None:
            assert labels[k] == -1, f"slot {k} should be empty, holds label {labels[k]}"
            continue
        item, width = entry
        assert labels[k] == item % K, f"slot {k}: label {labels[k]}, expected item {item} (label {item % K})"
        flat = torch.tensor(images[k]).flatten().tolist()
        assert flat == [item] * len(flat), f"slot {k}: image {flat}, expected item {item}"
        if with_logits:
            assert int(memory.width[k]) == width, f"slot {k}: width {int(memory.width[k])}, expected {width}"
            torch.testing.assert_close(memory.logits[k, :width], torch.tensor(item_logits(item, width)), rtol=0, atol=0)


def duplicate_seed(start: int, n: int, capacity: int, first: int) -> int:
    """The first seed >= ``first`` whose uniforms send two items of the batch to the same slot."""
    for seed in range(first, first + 20000):
        torch.manual_seed(seed)
        targets = [
            t
            for t in ref.reservoir_targets(start, capacity, torch.rand(n, dtype=torch.float64).tolist())
            if t is not None
        ]
        if len(targets) != len(set(targets)):
            return seed
    raise AssertionError("no seed with a duplicate slot found")


@pytest.mark.parametrize("sizes", [[1], [3], [5], [8], [2, 7, 1, 4]])
def test_reservoir_equals_the_sequential_rule_with_the_same_uniforms(sizes: list[int]) -> None:
    capacity, total = 6, 48
    memory = new_memory(capacity, logits=True)
    slots: list = [None] * capacity
    seen, call, duplicates = 0, 0, 0
    while seen < total:
        n = min(sizes[call % len(sizes)], total - seen)
        width = 2 if seen < total // 2 else 4  # stored logits of two widths (heads grow)
        seed = 7919 * call + 11
        if seen >= capacity and n >= 2 and call % 2 == 0:
            seed = duplicate_seed(seen, n, capacity, seed)  # a batch in which two items draw the same slot
        uniforms = offer(memory, seen, n, seed, width)
        targets = ref.reservoir_targets(seen, capacity, uniforms)
        hit = [t for t in targets if t is not None]
        if len(hit) != len(set(hit)):
            duplicates += 1
            last = {t: seen + i for i, t in enumerate(targets) if t is not None}  # the later item wins
            for slot, item in last.items():
                assert int(memory.labels[slot]) == item % K and int(memory.images[slot].flatten()[0]) == item
        slots, seen = ref.reservoir(slots, seen, [(seen + i, width) for i in range(n)], uniforms)
        assert int(memory.offered) == seen
        assert_state(memory, slots, capacity, with_logits=True)
        call += 1
    assert seen > capacity
    if max(sizes) >= 2:
        assert duplicates >= 1, "the stream never exercised two items drawing the same slot"


def test_the_first_capacity_items_fill_the_slots_in_order() -> None:
    capacity = 7
    memory = new_memory(capacity)
    seen = 0
    for call, n in enumerate([3, 2, 2]):
        offer(memory, seen, n, seed=100 + call, width=None)
        seen += n
        expected = [(i, 0) for i in range(seen)] + [None] * (capacity - seen)
        assert_state(memory, expected, capacity, with_logits=False)
    assert memory.labels[:capacity].tolist() == [i % K for i in range(capacity)]


def test_each_item_is_kept_with_probability_capacity_over_stream_length() -> None:
    """Over S seeded streams of N items into M slots, item i's keep count is Binomial(S, M/N) under the rule; its
    frequency must be within 5 binomial standard deviations of M/N (two-sided false alarm 5.7e-7 per item, < 1.2e-5
    for all N items together; the seeds are fixed, so the outcome is deterministic anyway)."""
    capacity, n_items, batch, streams = 5, 20, 4, 1000
    images = torch.arange(n_items).to(torch.uint8).view(n_items, 1, 1, 1).expand(n_items, *SHAPE).contiguous()
    labels = torch.arange(n_items) % K
    kept = [0] * n_items
    for s in range(streams):
        memory = new_memory(capacity)
        torch.manual_seed(1_000_003 * s)  # one seed per stream: each insert draws its uniforms after the last one's
        for start in range(0, n_items, batch):
            memory.insert(images[start : start + batch], labels[start : start + batch], task_id=0, logits=None)
            memory.offer_counted(batch)
        assert int((memory.labels[:capacity] >= 0).sum()) == capacity
        for item in memory.images[:capacity, 0, 0, 0].tolist():
            kept[item] += 1
    p = capacity / n_items
    tolerance = 5 * math.sqrt(p * (1 - p) / streams)
    frequencies = [k / streams for k in kept]
    bad = {i: f for i, f in enumerate(frequencies) if abs(f - p) > tolerance}
    assert not bad, f"keep frequency off M/N={p} by more than {tolerance:.4f}: {bad}"
    assert sum(kept) == capacity * streams


def test_draws_are_distinct_held_slots() -> None:
    capacity = 10
    memory = new_memory(capacity)
    offer(memory, 0, 7, seed=3, width=None)
    held = {k for k, label in enumerate(memory.labels[:capacity].tolist()) if label >= 0}
    assert held == set(range(7))
    for n in range(1, 8):
        for seed in range(5):
            torch.manual_seed(seed)
            drawn = memory.draw(n).tolist()
            assert len(drawn) == n and len(set(drawn)) == n, f"draw({n}) = {drawn}: not distinct"
            assert set(drawn) <= held, f"draw({n}) = {drawn}: outside the held slots {sorted(held)}"
    torch.manual_seed(0)
    assert set(memory.draw(7).tolist()) == held
    offer(memory, 7, 20, seed=4, width=None)  # now full
    torch.manual_seed(1)
    assert sorted(memory.draw(capacity).tolist()) == list(range(capacity))


# ------------------------------------------------------------------------------------------------------------- ER
def two_task_method(*overrides: str):
    method, rt = build_runtime(tiny_config(*overrides))
    t0, t1 = rt.benchmark.tasks[0], rt.benchmark.tasks[1]
    method.before_task(t0)
    method.before_task(t1)
    return method, t1


def outputs(method, x: torch.Tensor) -> list[list[float]]:
    with torch.no_grad():
        return method.seen_logits(method.features(x, None)).double().tolist()


def test_er_loss_is_the_mean_over_the_concatenated_rows() -> None:
    method, t1 = two_task_method("method=er")
    seen = t1.offset + t1.num_classes
    torch.manual_seed(5)
    b, m = 3, 5
    x = torch.randn(b, 3, 16, 16)
    y = torch.randint(t1.offset, seen, (b,))
    xm = torch.randn(m, 3, 16, 16)
    ym = torch.tensor([0, 1, 2, 3, 0])
    z, zm = outputs(method, x), outputs(method, xm)
    assert len(z[0]) == seen
    loss, _ = method.training_loss(x, y, t1, replay=(Replay(xm, ym),))
    expected = ref.er_loss(z, y.tolist(), zm, ym.tolist())
    not_this = ref.er_mean_of_means(z, y.tolist(), zm, ym.tolist())
    assert abs(expected - not_this) > 1e-2  # the two readings differ on these tensors
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert abs(loss.item() - not_this) > 1e-2
    empty, _ = method.training_loss(x, y, t1)  # an empty memory: plain CE over the current rows (seen classes)
    assert empty.item() == pytest.approx(ref.mean(ref.cross_entropy_rows(z, y.tolist())), rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------- DER++
def derpp_inputs(t1):
    seen = t1.offset + t1.num_classes
    torch.manual_seed(9)
    b, m = 3, 4
    x = torch.randn(b, 3, 16, 16)
    y = torch.randint(t1.offset, seen, (b,))
    x1 = torch.randn(m, 3, 16, 16)
    y1 = torch.tensor([0, 1, 2, 3])
    w1 = torch.tensor([2, 4, 4, 2])  # logits stored while one head existed (width 2) and two heads (width 4)
    z1 = torch.full((m, K), 50.0)  # padding past each row's width: must never enter the MSE
    for i, w in enumerate(w1.tolist()):
        z1[i, :w] = torch.randn(w)
    x2 = torch.randn(m, 3, 16, 16)
    y2 = torch.tensor([3, 2, 1, 0])
    z2 = torch.randn(m, K)  # the second draw's stored logits: only its labels enter the loss
    w2 = torch.tensor([4, 2, 2, 4])
    return x, y, (x1, y1, z1, w1), (x2, y2, z2, w2)


def test_derpp_is_the_three_term_loss_with_the_mse_over_valid_widths() -> None:
    alpha, beta = 0.3, 0.7  # not the defaults (0.1, 0.5)
    method, t1 = two_task_method("method=derpp", f"method.alpha={alpha}", f"method.beta={beta}")
    x, y, (x1, y1, z1, w1), (x2, y2, z2, w2) = derpp_inputs(t1)
    z, f1, f2 = outputs(method, x), outputs(method, x1), outputs(method, x2)
    loss, _ = method.training_loss(x, y, t1, replay=(Replay(x1, y1, z1, w1), Replay(x2, y2, z2, w2)))
    expected = ref.derpp_loss(
        z,
        y.tolist(),
        draw1_logits=f1,
        draw1_stored=z1.double().tolist(),
        draw1_widths=w1.tolist(),
        draw2_logits=f2,
        draw2_labels=y2.tolist(),
        alpha=alpha,
        beta=beta,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # the stored logits the reservoir will keep: the current rows' outputs of this step
    stored = method.stored_logits
    assert stored.shape[0] == x.shape[0] and stored.shape[1] >= len(z[0])
    torch.testing.assert_close(
        stored[:, : len(z[0])].double(), torch.tensor(z, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )


def test_derpp_with_beta_zero_is_der() -> None:
    alpha = 0.3
    method, t1 = two_task_method("method=derpp", f"method.alpha={alpha}", "method.beta=0.0")
    x, y, (x1, y1, z1, w1), (x2, y2, z2, w2) = derpp_inputs(t1)
    z, f1 = outputs(method, x), outputs(method, x1)
    der = ref.mean(ref.cross_entropy_rows(z, y.tolist())) + alpha * ref.masked_mse(
        f1, z1.double().tolist(), w1.tolist()
    )
    first = Replay(x1, y1, z1, w1)
    loss, _ = method.training_loss(x, y, t1, replay=(first, Replay(x2, y2, z2, w2)))
    assert loss.item() == pytest.approx(der, rel=1e-5, abs=1e-6)
    other, _ = method.training_loss(x, y, t1, replay=(first, Replay(torch.randn_like(x2), y2.flip(0), z2, w2)))
    assert other.item() == loss.item()  # the second draw no longer matters
