"""Honest evaluation, for every method clbench registers (``clbench.methods.METHODS``: a method added later is checked
without touching this file).

1. Per sample: an image's logits, in both scenarios, are the same whether it is evaluated alone, inside a batch of
   other images (of every task, the untrained one too) or that batch reversed, and after other images were predicted.
2. No task id in CIL: the class-incremental logits are the same whatever task id the evaluation hands over for TIL,
   whatever task ``evaluating`` announces, through the evaluation itself with the same images filed under each task
   (which changes the caller's state, the order of the calls and the images' labels), and equal to ``predict(x, None)``
   called outside any evaluation; and the method holds no reference to the test or validation data, the only place
   their labels are.
3. A batch-level option (L2P's and DualPrompt's prompt vote) is off by default and named in results.json; turned on,
   the per-sample check catches it (slow: on the embedded default, whose pretrained features tell images apart).

The checks themselves are tested on methods built here to cheat (``SNEAKY``): each way of peeking is caught.

Every method trains two of three tasks of the tests' tiny setup (conftest's TINY; TINY_FIT fits a method whose
official layers do not exist there), one epoch each: under a second a method. ``OTHER_PATHS`` adds the settings whose
prediction takes a path that a method's default does not.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import types
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import get_class

from clbench.config import config_dir, validate
from clbench.data import Benchmark, Split
from clbench.evaluation import SCENARIOS, evaluate, scenario_logits
from clbench.loop import train
from clbench.loop.runtime import Runtime, build_runtime
from clbench.loop.task import run_task
from clbench.methods import METHODS
from clbench.methods.base import Method
from clbench.methods.finetune import Finetune
from conftest import compose_config, tiny_config

# Settings whose prediction takes a path its method's default does not, with the reason.
OTHER_PATHS: dict[str, list[tuple[str, ...]]] = {
    "supsup": [("method.inference=binary",), ("method.inference=lowest_entropy",)],  # its other CIL task inferences
    # the other parameter-efficient modules of the shared parts (RanPAC attaches the same ones)
    "aper": [(f"method.petl={petl}",) for petl in ("ssf", "vpt_deep", "vpt_shallow", "finetune")],
    "mos": [("method.proto_branch=ptm", "method.ensemble=false")],  # the bare ViT's prototypes, the refined logits
}
CASES = [(f"method={m}",) for m in METHODS] + [(f"method={m}", *o) for m, paths in OTHER_PATHS.items() for o in paths]
TRAINED_TASKS = 2  # of TINY's 3: the third stays untrained (its images join the batches; cil_classes=all scores it)
PER_TASK = 4  # test images of each task in a batch

# Two honest evaluations of one image do the same arithmetic on the same numbers, except that a kernel may group the
# additions of a reduction otherwise for another batch size (BLAS blocking, vector lanes, a remainder loop). Two orders
# of a sum of n terms differ by at most 2 gamma_n sum|terms|, gamma_n = n u / (1 - n u) ~ n u, u = 2^-24 in fp32
# (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5). No reduction is longer than the largest
# dimension n of a tensor the method holds (features, hidden units, tokens: the positional table, prompts, random
# features); the logits pass through at most REDUCTIONS of them in a row (per block: norm, qkv, scores, softmax,
# values, projection, norm, fc1, fc2; the final norm and the head: 11, twice with a query pass, and a margin), and
# each layer passes a relative error on at most at its size. Hence 2 n REDUCTIONS u relative to the largest logit.
# Measured: at most 34 u (2e-6, L2P), every other method within 7 u; a batch-level rule or a peek moves logits by O(1).
UNIT_ROUNDOFF = 2.0**-24
REDUCTIONS = 32


def rounding_tolerance(method: Method) -> float:
    """The relative tolerance of two honest evaluations of an image (see above)."""
    n = max(max(t.shape, default=1) for t in (*method.parameters(), *method.buffers()))
    return 2 * n * REDUCTIONS * UNIT_ROUNDOFF


def assert_same(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """``got`` equals ``want`` to ``tol`` times ``want``'s largest finite magnitude, their infinities (a
    task-conditioned method's -inf outside the inferred task) in the same places; no NaN."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert not got.isnan().any() and not want.isnan().any(), f"{what}: NaN"
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[~finite], want[~finite]), (
        f"{what}: the infinite logits (the inferred tasks) differ"
    )
    if finite.any():
        err, scale = (got[finite] - want[finite]).abs().max().item(), want[finite].abs().max().item()
        assert err <= tol * scale, f"{what}: differs by {err:.3g}, over the rounding tolerance {tol * scale:.3g}"


@functools.cache
def trained(case: tuple[str, ...], setup: str = "tiny") -> tuple[Method, Runtime]:
    """The method of ``case`` after :data:`TRAINED_TASKS` of three tasks, one epoch each, as the loop trains them, in
    eval mode (cached: the tests share it). ``setup``: ``tiny`` (conftest's TINY) or ``default`` (the embedded digits
    and the shipped pretrained micro ViT)."""
    if setup == "tiny":
        cfg = tiny_config(*case, "trainer.epochs=1")
    else:
        cfg = validate(compose_config("logger.mode=disabled", "data.num_tasks=3", "trainer.epochs=1", *case))
    method, rt = build_runtime(cfg)
    for task in rt.benchmark.tasks[:TRAINED_TASKS]:
        method.before_task(task)
        if method.memory is not None:
            method.memory.start_task(task, rt.benchmark.train[task.id].y.cpu())
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
    method.eval()
    return method, rt


def probe_images(rt: Runtime) -> torch.Tensor:
    """The first :data:`PER_TASK` test images of every task of the benchmark, as the evaluation feeds them."""
    return rt.test_tf(torch.cat([split.x[:PER_TASK] for split in rt.benchmark.test]))


def cil_class_sets(method: Method) -> tuple[str, ...]:
    """The classes CIL may run over for ``method``: the seen ones; every class where it scores unseen ones."""
    return ("seen", "all") if method.scores_unseen_classes() else ("seen",)


# ----------------------------------------------------------------------------- 1. per sample
def check_per_sample(method: Method, x: torch.Tensor, cil_classes: str) -> None:
    """Each image's logits (the evaluation's, and ``predict``'s) alone, inside ``x``, inside ``x`` reversed, and again
    after all the others were predicted, are the same; and predicting changes no parameter."""
    tol = rounding_tolerance(method)
    before = {name: p.detach().clone() for name, p in method.named_parameters()}
    first = scenario_logits(method, x, 0, SCENARIOS, cil_classes)
    for j in range(method.num_seen):
        together = scenario_logits(method, x, j, SCENARIOS, cil_classes)
        reverse = scenario_logits(method, x.flip(0), j, SCENARIOS, cil_classes)
        alone = [scenario_logits(method, x[i : i + 1], j, SCENARIOS, cil_classes) for i in range(len(x))]
        for s in SCENARIOS:
            single = torch.cat([a[s] for a in alone])
            assert_same(together[s], single, tol, f"{s}, task {j}: the batch against each image alone")
            assert_same(reverse[s].flip(0), single, tol, f"{s}, task {j}: the batch reversed against each image alone")
        if cil_classes == "seen":  # the contract's own call
            for task_id in (j, None):
                single = torch.cat([method.predict(x[i : i + 1], task_id) for i in range(len(x))])
                assert_same(method.predict(x, task_id), single, tol, f"predict(x, {task_id}): batch against alone")
    again = scenario_logits(method, x, 0, SCENARIOS, cil_classes)
    for s in SCENARIOS:
        assert_same(again[s], first[s], tol, f"{s}: the same batch before and after the others were predicted")
    changed = [name for name, p in method.named_parameters() if not torch.equal(p, before[name])]
    assert not changed, f"predicting changed {changed}"


@pytest.mark.parametrize("case", CASES, ids=",".join)
def test_an_images_logits_do_not_depend_on_the_rest_of_its_batch(case: tuple[str, ...]) -> None:
    method, rt = trained(case)
    assert method.batch_level(method.config) == []  # the default evaluation
    for cil_classes in cil_class_sets(method):
        check_per_sample(method, probe_images(rt), cil_classes)


# ----------------------------------------------------------------------------- 2. no task id in CIL
def filed_under_every_task(rt: Runtime, images: torch.Tensor, seen: int) -> Benchmark:
    """A benchmark whose every seen task's test split holds the same ``images``, labelled with that task's first
    class: evaluating it hands the method each task id in turn with the very same images."""
    b = rt.benchmark
    test = [Split(images, torch.full((len(images),), b.tasks[t].offset)) for t in range(seen)]
    return Benchmark(b.name, b.tasks, b.train, test + b.test[seen:])


def evaluated_cil(
    method: Method, rt: Runtime, images: torch.Tensor, cil_classes: str
) -> list[tuple[int, torch.Tensor]]:
    """The task ids the evaluation handed over and the CIL logits it counted, evaluating ``images`` as each seen
    task's test data in one batch (so every call sees the same batch)."""
    calls, real = [], method.predict_scenarios

    def recorded(x: torch.Tensor, task_id: int, *args: object) -> dict[str, torch.Tensor]:
        out = real(x, task_id, *args)
        calls.append((task_id, out["cil"]))
        return out

    method.predict_scenarios = recorded
    try:
        seen = method.num_seen
        bench = filed_under_every_task(rt, images, seen)
        kwargs = {"transform": rt.test_tf, "autocast": nullcontext(), "cil_classes": cil_classes}
        evaluate(method, bench, list(range(seen)), batch_size=len(images), **kwargs)
    finally:
        del method.predict_scenarios
    return calls


def check_no_task_id(method: Method, rt: Runtime, cil_classes: str) -> None:
    """CIL logits equal ``predict(x, None)`` outside any evaluation (or its scores of unseen classes appended), for
    every task id handed over and every task announced by ``evaluating``, through the real evaluation too."""
    tol = rounding_tolerance(method)
    raw = torch.cat([split.x[:PER_TASK] for split in rt.benchmark.test])
    x = rt.test_tf(raw)
    plain = method.predict_scenarios(x, 0, ("cil",), cil_classes)["cil"]
    if cil_classes == "seen":
        assert_same(plain, method.predict(x, None), tol, "predict_scenarios' CIL against predict(x, None)")
    seen = range(method.num_seen)
    for j in seen:
        for announced in seen:
            for scenarios in (("cil",), SCENARIOS):
                with method.evaluating(announced):
                    got = method.predict_scenarios(x, j, scenarios, cil_classes)["cil"]
                assert_same(got, plain, tol, f"CIL with task id {j} handed over while evaluating task {announced}")
    calls = evaluated_cil(method, rt, raw, cil_classes)
    assert [task_id for task_id, _ in calls] == list(seen)  # the evaluation handed each task id over (for TIL)
    for task_id, cil in calls:
        assert_same(cil, plain, tol, f"the evaluation's CIL with the images filed under task {task_id}")
    check_holds_no_evaluation_data(method, rt.benchmark)


def reachable(root: object) -> Iterator[object]:
    """Every object reachable from ``root`` through instance attributes, containers, closures and bound methods (not
    through classes or modules)."""
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes, int, float, complex)):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
        elif isinstance(obj, types.FunctionType):
            stack += [cell.cell_contents for cell in obj.__closure__ or () if cell_filled(cell)]
        elif isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
        else:
            stack += list(getattr(obj, "__dict__", {}).values())
            stack += [getattr(obj, name) for name in slot_names(type(obj)) if hasattr(obj, name)]


def cell_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def slot_names(cls: type) -> list[str]:
    return [name for klass in inspect.getmro(cls) for name in getattr(klass, "__slots__", ()) if isinstance(name, str)]


def check_holds_no_evaluation_data(method: Method, benchmark: Benchmark) -> None:
    """Nothing reachable from the method is the benchmark, a test or validation split, or a tensor sharing memory
    with their images or labels: the labels (and with them each image's task) are out of its reach."""
    splits = [*benchmark.test, *benchmark.validation]
    tensors = [t for s in splits for t in (s.x, s.y) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    for obj in reachable(method):
        assert obj is not benchmark and not any(obj is s for s in splits), f"the method holds {type(obj).__name__}"
        if isinstance(obj, torch.Tensor) and obj.numel():
            assert obj.untyped_storage().data_ptr() not in storages, "the method holds the test data's memory"


@pytest.mark.parametrize("case", CASES, ids=",".join)
def test_no_class_incremental_logit_reads_the_task_id(case: tuple[str, ...]) -> None:
    method, rt = trained(case)
    for cil_classes in cil_class_sets(method):
        check_no_task_id(method, rt, cil_classes)


# ----------------------------------------------------------------------------- 3. batch-level options
def method_class(name: str) -> type[Method]:
    """The class conf/method/<name>.yaml names."""
    node = yaml.safe_load((config_dir() / "method" / f"{name}.yaml").read_text())["method"]
    return get_class(node["_target_"])


def turned_on(option: str) -> tuple[str, str]:
    """The override that turns a batch-level option on (``key=true``, or the ``key=value`` it names) and its key."""
    key, _, value = option.partition("=")
    return f"method.{key}={value or 'true'}", f"method.{key}"


@pytest.mark.parametrize("name", METHODS)
def test_batch_level_options_are_off_by_default(name: str) -> None:
    """A boolean key is False, a ``key=value`` choice holds another value."""
    cls, config = method_class(name), tiny_config(f"method={name}").method
    for option in cls.batch_level_options:
        key, _, value = option.partition("=")
        if value:
            assert str(getattr(config, key)) != value, f"method.{key}={value} by default"
        else:
            assert getattr(config, key) is False, f"method.{key} is on by default"
    assert cls.batch_level(config) == []


BATCH_LEVEL = [(m, option) for m in METHODS for option in method_class(m).batch_level_options]


@pytest.mark.parametrize(("name", "key"), [(BATCH_LEVEL[0][0], None), *BATCH_LEVEL])
def test_a_batch_level_option_is_named_in_results(name: str, key: str | None, tmp_path: Path) -> None:
    """Turned on, the option is what results.json names; the default run (``key`` None) names none."""
    on = [] if key is None else [turned_on(key)]
    named = [k for _, k in on]
    train(tiny_config(f"method={name}", *(o for o, _ in on), "data.num_tasks=1", "trainer.epochs=1"), tmp_path)
    evaluation = json.loads((tmp_path / "results.json").read_text())["evaluation"]
    assert evaluation == {"per_sample": not named, "batch_level": named}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "key"), BATCH_LEVEL)
def test_a_batch_level_option_is_caught_by_the_per_sample_check(name: str, key: str) -> None:
    """Turned on, the option's predictions do depend on the batch, which the per-sample check catches. On the
    embedded default: the tiny setup's random backbone gives every image nearly the same query, so each picks the
    same prompts and a vote over them changes nothing; the pretrained micro ViT's queries tell the images apart."""
    method, rt = trained((f"method={name}", turned_on(key)[0]), "default")
    with pytest.raises(AssertionError, match="against each image alone"):
        check_per_sample(method, probe_images(rt), "seen")


# ----------------------------------------------------------------------------- the checks catch cheats
class BatchStatistics(Finetune):
    """Centres the features on the batch's mean (a BatchNorm left in training mode at test)."""

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        feats = super().features(x, task_id)
        return feats - feats.mean(0, keepdim=True)


def only_task(method: Method, logits: torch.Tensor, task_id: int | None) -> torch.Tensor:
    """CIL logits narrowed to ``task_id``'s classes: what a method that learned the task id would return."""
    if task_id is None:
        return logits
    task = method.tasks[task_id]
    keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
    keep[task.offset : task.offset + task.num_classes] = True
    return logits.masked_fill(~keep, float("-inf"))


class ReadsTheHandedId(Finetune):
    """Narrows CIL to the task id handed over for TIL."""

    def predict_scenarios(self, x: torch.Tensor, task_id: int, *args: object) -> dict[str, torch.Tensor]:
        out = super().predict_scenarios(x, task_id, *args)
        return {s: only_task(self, v, task_id) if s == "cil" else v for s, v in out.items()}


class ReadsEvaluating(Finetune):
    """Keeps the task ``evaluating`` announces and narrows CIL to it."""

    announced: int | None = None

    @contextmanager
    def evaluating(self, task_id: int) -> Iterator[None]:
        self.announced = task_id
        try:
            yield
        finally:
            self.announced = None

    def predict(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        out = super().predict(x, task_id)
        return only_task(self, out, self.announced) if task_id is None else out


class ReadsTheCaller(Finetune):
    """Finds the evaluated task in the evaluation's frame (``evaluate``'s local ``j``)."""

    def predict_scenarios(self, x: torch.Tensor, task_id: int, *args: object) -> dict[str, torch.Tensor]:
        out = super().predict_scenarios(x, task_id, *args)
        frame = inspect.currentframe()
        while frame is not None and frame.f_code.co_name != "evaluate":
            frame = frame.f_back
        found = frame.f_locals["j"] if frame is not None else None
        return {s: only_task(self, v, found) if s == "cil" else v for s, v in out.items()}


class RemembersTheHandedId(Finetune):
    """Narrows CIL to the task id handed over in the call before (a stored attribute)."""

    last: int | None = None

    def predict_scenarios(self, x: torch.Tensor, task_id: int, *args: object) -> dict[str, torch.Tensor]:
        out = super().predict_scenarios(x, task_id, *args)
        narrowed = {s: only_task(self, v, self.last) if s == "cil" else v for s, v in out.items()}
        self.last = task_id
        return narrowed


class DriftsWhilePredicting(Finetune):
    """Moves its weights a little with every prediction (adapters merged in place at test)."""

    def predict_scenarios(self, x: torch.Tensor, task_id: int, *args: object) -> dict[str, torch.Tensor]:
        self.heads[0].bias.add_(0.5)
        return super().predict_scenarios(x, task_id, *args)


class CountsItsCalls(Finetune):
    """Guesses the task from the order of the calls since ``eval()`` (the evaluation goes through the tasks in
    order)."""

    calls = 0

    def train(self, mode: bool = True) -> CountsItsCalls:
        self.calls = 0
        return super().train(mode)

    def predict_scenarios(self, x: torch.Tensor, task_id: int, *args: object) -> dict[str, torch.Tensor]:
        out = super().predict_scenarios(x, task_id, *args)
        guess, self.calls = self.calls % self.num_seen, self.calls + 1
        return {s: only_task(self, v, guess) if s == "cil" else v for s, v in out.items()}


class KeepsTheBenchmark(Finetune):
    """Keeps the benchmark it was built with: the test labels are in its reach."""


class KeepsTheTestLabels(Finetune):
    """Keeps a view of the first task's test labels."""


SNEAKY = {
    BatchStatistics: "against each image alone",
    ReadsTheHandedId: r"against predict\(x, None\)",
    ReadsEvaluating: "while evaluating task",
    ReadsTheCaller: "filed under task",
    RemembersTheHandedId: "the infinite logits",
    DriftsWhilePredicting: "against each image alone",
    CountsItsCalls: "the infinite logits",
    KeepsTheBenchmark: "the method holds Benchmark",
    KeepsTheTestLabels: "the test data's memory",
}


@pytest.mark.parametrize("cheat", list(SNEAKY), ids=lambda c: c.__name__)
def test_the_checks_catch_a_method_that_cheats(cheat: type[Method]) -> None:
    """A copy of Finetune after two tasks, made to cheat one way: one of the two checks fails, saying where. Finetune
    itself passes both (above)."""
    honest, rt = trained(("method=finetune",))
    method = copy.deepcopy(honest)
    method.__class__ = cheat
    if cheat is KeepsTheBenchmark:
        method.kept = rt.benchmark
    if cheat is KeepsTheTestLabels:
        method.kept = {"labels": rt.benchmark.test[0].y[1:]}
    with pytest.raises(AssertionError, match=SNEAKY[cheat]):
        check_per_sample(method, probe_images(rt), "seen")
        check_no_task_id(method, rt, "seen")
