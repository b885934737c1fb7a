"""End-to-end runs of the reference methods on tiny data: the results.json contract and the run folder."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from clbench.config import validate
from clbench.errors import ClbenchError, ConfigError, DataError
from clbench.loop import train
from clbench.loop.divergence import blame
from clbench.loop.optim import lr_factor
from clbench.loop.runtime import Runtime, build_runtime
from clbench.loop.task import run_task
from clbench.methods import TRAINED
from clbench.methods.finetune import Finetune
from clbench.reevaluate import reevaluate
from conftest import TINY, baselines_slow, compose_config, tiny_config, tiny_fit

TASKS = 3


def run_tiny(tmp_path: Path, *overrides: str):
    cfg = tiny_config(*overrides)
    return train(cfg, tmp_path), json.loads((tmp_path / "results.json").read_text())


def assert_lower_triangular(matrix: list[list[float | None]]) -> None:
    assert len(matrix) == TASKS and all(len(row) == TASKS for row in matrix)
    for i, row in enumerate(matrix):
        assert all(isinstance(v, float) and 0 <= v <= 100 for v in row[: i + 1])
        assert all(v is None for v in row[i + 1 :])


def test_results_record_the_versions_device_and_commit_they_were_measured_with(tmp_path: Path) -> None:
    import platform
    import subprocess

    import timm

    from clbench.provenance import git_state

    _, res = run_tiny(tmp_path, "method=finetune", "data.num_tasks=1", "trainer.epochs=1")
    versions = res["versions"]
    assert versions["python"] == platform.python_version() and versions["timm"] == timm.__version__
    assert versions["torch"] == torch.__version__ and versions["cuda"] is None and versions["cudnn"] is None
    assert versions["device"].startswith("CPU (")
    source = Path(__file__).resolve().parent  # the checkout the tests (and clbench, installed editable) come from
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True, check=True)
    assert res["git_commit"] == head.stdout.strip() and isinstance(res["git_dirty"], bool)
    assert git_state(tmp_path) == (None, None)  # outside a checkout (an installed wheel): nothing claimed


def test_finetune_results_follow_the_contract(tmp_path: Path) -> None:
    _, res = run_tiny(tmp_path, "method=finetune")
    assert res["status"] == "finished" and res["method"] == "finetune"
    assert (res["benchmark"], res["backbone"], res["seed"], res["class_order_seed"]) == (
        "synthetic_tiny_first3",  # TINY runs the first 3 of its 5 tasks
        "vit_micro",
        0,
        1993,
    )
    assert [t["id"] for t in res["tasks"]] == [0, 1, 2] and len(res["tasks"][0]["classes"]) == 2
    for s in ("til", "cil"):
        assert_lower_triangular(res["acc_matrix"][s])
        f = res["forgetting_matrix"][s]
        assert f[0] == [None] * TASKS and f[2][2] is None and isinstance(f[2][0], float)
        m = res["metrics"][s]
        assert set(m) >= {"final_acc", "avg_incremental_acc", "forgetting", "bwt", "fwt"}
        assert m["final_acc"] == pytest.approx(sum(res["acc_matrix"][s][-1]) / TASKS)
        assert len(res["random_init_acc"][s]) == TASKS
    assert len(res["storage"]["bits_per_task"]) == TASKS and res["storage"]["trainable_params"] > 0
    for key in ("train_s", "eval_s", "train_images_per_s"):
        assert len(res["timing"][key]) == TASKS
    for name in (
        "acc_matrix_til.csv",
        "acc_matrix_cil.csv",
        "forgetting_matrix_cil.csv",
        "heatmap_til.png",
        "heatmap_cil.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "heatmap_cil.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "acc_matrix_til.csv").read_text().splitlines()[0] == "after_task,task_0,task_1,task_2"


def test_finetune_forgets_in_class_incremental_and_joint_does_not(tmp_path: Path) -> None:
    overrides = ("trainer.epochs=6",)
    _, ft = run_tiny(tmp_path / "ft", "method=finetune", *overrides)
    _, joint = run_tiny(tmp_path / "joint", "method=joint", *overrides)
    # finetune learns each task, then its growing head forgets the old classes
    assert ft["acc_matrix"]["cil"][0][0] > 80
    assert ft["acc_matrix"]["cil"][-1][0] < 20
    assert ft["metrics"]["cil"]["forgetting"] > 50
    assert joint["metrics"]["cil"]["final_acc"] > ft["metrics"]["cil"]["final_acc"] + 30


def test_same_seed_same_results_and_random_init_probe_does_not_change_training(tmp_path: Path) -> None:
    _, a = run_tiny(tmp_path / "a")
    _, b = run_tiny(tmp_path / "b")
    _, c = run_tiny(tmp_path / "c", "trainer.eval_random_init=false")
    assert a["acc_matrix"] == b["acc_matrix"] == c["acc_matrix"]
    assert c["random_init_acc"] is None and c["metrics"]["til"]["fwt"] is None


def test_wandb_offline_writes_a_run_folder(tmp_path: Path) -> None:
    run_tiny(tmp_path, "logger.mode=offline", "data.num_tasks=1")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_a_failing_run_records_the_failure_and_keeps_finished_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_evaluate = Runtime.evaluate

    def evaluate_then_fail(self, method, task_ids, scenarios=("til", "cil"), split="test"):
        if len(task_ids) == 2 and scenarios == ("til", "cil"):  # after task 1
            raise RuntimeError("disk on fire")
        return real_evaluate(self, method, task_ids, scenarios, split)

    monkeypatch.setattr(Runtime, "evaluate", evaluate_then_fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        run_tiny(tmp_path, "trainer.eval_random_init=false")
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["status"] == "failed" and "disk on fire" in res["failure"]
    assert len(res["acc_matrix"]["til"]) == 1  # task 0's row survived
    assert not list(tmp_path.glob(".results.json.*"))  # no temp file left behind


@pytest.mark.parametrize(
    ("log_every", "where"),
    [
        ("1", r"epoch 0, step \d+"),  # at a log step
        ("1000", r"epoch 0 \(its end\)"),  # a task shorter than log_every: at the epoch's end
    ],
)
def test_a_nan_loss_stops_the_run_naming_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_every: str, where: str
) -> None:
    """A NaN loss stops the run before its task is recorded, whether or not the task reaches a log step."""
    real_loss = Finetune.training_loss

    def nan_in_task_1(self, x, y, task):
        loss, logs = real_loss(self, x, y, task)
        return (loss * float("nan") if task.id == 1 else loss), logs

    monkeypatch.setattr(Finetune, "training_loss", nan_in_task_1)
    with pytest.raises(FloatingPointError, match=rf"is nan at task 1 \(train phase\), {where}"):
        run_tiny(tmp_path, "trainer.eval_random_init=false", f"trainer.log_every={log_every}")
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["status"] == "failed" and "Diverged" in res["failure"] and len(res["acc_matrix"]["til"]) == 1


@pytest.mark.parametrize(
    ("method", "from_call", "blamed"),
    [
        ("lwf", 1, r"the loss's term kd went non-finite at the phase's step 1 \(loss inf, kd inf\), before any update"),
        ("bic", 2, r"the first non-finite value was the loss's term kd at the phase's step 2 \(.*\), while ce stayed"),
    ],
)
def test_the_nan_guard_names_the_term_that_went_non_finite_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, from_call: int, blamed: str
) -> None:
    """A term of the loss that overflows on its own (here the distillation, made infinite from its ``from_call``-th
    call: task 1's train phase) is named with the values of the loss's parts at that step, and the learning rate is
    not blamed (before, every NaN was "lower trainer.lr")."""
    module = importlib.import_module(f"clbench.methods.{method}")
    real, calls = module.distillation, {"n": 0}

    def overflowing(*args: object) -> torch.Tensor:
        calls["n"] += 1
        return real(*args) * (float("inf") if calls["n"] >= from_call else 1.0)

    monkeypatch.setattr(module, "distillation", overflowing)
    overrides = (f"method={method}", "trainer.epochs=1", "trainer.log_every=1", "trainer.eval_random_init=false")
    with pytest.raises(FloatingPointError, match=rf"at task 1 \(train phase\), epoch 0, step \d+; {blamed}") as err:
        bic = ("memory.size=null", "memory.per_class=4", "method.bias_epochs=1") if method == "bic" else ()
        run_tiny(tmp_path, *overrides, *bic)
    assert "trainer.lr" not in str(err.value) and "method.*" in str(err.value)


def test_the_nan_guard_blames_what_the_values_at_the_first_non_finite_step_point_at() -> None:
    """Each case of :func:`clbench.loop.divergence.blame`: only after an update can the learning rate be the cause."""
    inf, nan = float("inf"), float("nan")
    assert "lower trainer.lr" in blame({"loss": nan}, 3)
    assert "before any update" in blame({"loss": nan}, 0) and "trainer.lr" not in blame({"loss": nan}, 0)
    both = blame({"loss": nan, "ewc_penalty": nan}, 4)  # one term, after an update: either cause
    assert "ewc_penalty overflowed on its own" in both and "lower trainer.lr" in both
    assert "while ce stayed finite" in blame({"loss": inf, "kd": inf, "ce": 0.5}, 4)
    assert "logged terms stayed finite" in blame({"loss": inf, "kd": 0.5}, 4)


def test_frozen_backbone_finetune_leaves_backbone_bit_identical() -> None:
    method, rt = build_runtime(tiny_config("method.freeze_backbone=true"))
    before = {k: v.clone() for k, v in method.backbone.state_dict().items()}
    for task in rt.benchmark.tasks[:2]:
        method.before_task(task)
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
    assert all(torch.equal(before[k], v) for k, v in method.backbone.state_dict().items())
    assert not any(p.requires_grad for p in method.backbone.parameters())


def test_lr_schedule_warmup_then_cosine_to_floor() -> None:
    cfg = tiny_config("trainer.lr=1.0", "trainer.min_lr=0.1").trainer
    assert lr_factor(0, 100, 10, cfg) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, cfg) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, cfg) == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, cfg) == pytest.approx(0.1)


def test_lr_schedule_exponential_is_a_staircase_a_epoch() -> None:
    """APD's code: tf.train.exponential_decay(lr, global_step, decay_steps=batches a epoch, 0.95, staircase=True)."""
    cfg = tiny_config("trainer.schedule=exponential", "trainer.lr_decay=0.5").trainer
    assert [lr_factor(s, 40, 0, cfg, per_epoch=4) for s in (0, 3, 4, 7, 8, 39)] == [1, 1, 0.5, 0.5, 0.25, 0.5**9]


class CodaCosineSchedule:
    """CODA-Prompt's utils/schedulers.py CosineSchedule (InfLoRA copies it), transcribed: its constructor steps to
    epoch 0 and then sets last_epoch back to -1."""

    def __init__(self, base: float, k: int) -> None:
        self.base, self.k, self.last_epoch = base, k, -1
        self.lr = self.cosine(0)

    def cosine(self, epoch: int) -> float:
        return self.base * math.cos((99 * math.pi * epoch) / (200 * (self.k - 1)))

    def step(self) -> None:
        self.last_epoch += 1
        self.lr = self.cosine(self.last_epoch)


@pytest.mark.parametrize("epochs", [2, 5, 20])
def test_coda_cosine_is_codas_schedule_as_its_loop_and_inflora_s_step_it(epochs: int) -> None:
    """CODA-Prompt's loop steps before every epoch but the first (learners/default.py L95), InfLoRA's after every
    epoch (methods/inflora.py L238): both train epoch e at the lr the transcription holds then; clbench's factor holds
    that lr for every step of the epoch."""
    cfg = tiny_config("trainer.schedule=coda_cosine", "trainer.lr=1.0").trainer
    coda, inflora = CodaCosineSchedule(1.0, epochs), CodaCosineSchedule(1.0, epochs)
    per_epoch = 3
    for epoch in range(epochs):
        if epoch > 0:
            coda.step()
        mine = [lr_factor(epoch * per_epoch + i, epochs * per_epoch, 0, cfg, per_epoch) for i in range(per_epoch)]
        assert mine == pytest.approx([coda.lr] * per_epoch) and coda.lr == pytest.approx(inflora.lr)
        inflora.step()
    assert coda.lr == pytest.approx(math.cos(99 * math.pi * (epochs - 2) / (200 * (epochs - 1))))


def test_heatmap_renders_negative_forgetting() -> None:
    from clbench.data import Task
    from clbench.evaluation import Evaluation
    from clbench.results import Results
    from clbench.tracking import heatmap_png

    tasks = [Task(i, (i,), (str(i),), i) for i in range(2)]
    results = Results({"method": "m", "benchmark": "b"}, tasks)
    for accuracy in ({"til": [50.0], "cil": [50.0]}, {"til": [70.0, 90.0], "cil": [60.0, 90.0]}):
        results.add_stage(Evaluation(accuracy, {}, {}, None))  # after task 1: task 0 improved, forgetting -20
    assert results.forgetting_rows("til")[1][0] == -20.0
    assert heatmap_png(results, "til")[:4] == b"\x89PNG"


AGAIN_EXTRA = {"packnet": ("method.retrain_epochs=1",), "supsup-gn": ("method.head=masked", "method.outputs=4")}


# MIN's artifacts against what its evaluation reads: tests/test_min.py. In make test-all (8-17 s each): CODA-Prompt's
# (L2P's and DualPrompt's in the default suite), SupSup's (its GN variant in it), Piggyback's (PackNet's and HAT's in
# it) and SD-LoRA's (InfLoRA's in it)
AGAIN_SLOW = ("min", "coda_prompt", "supsup", "piggyback", "sdlora")


@pytest.mark.parametrize("case", [*baselines_slow([m for m in TRAINED if m != "joint"], also=AGAIN_SLOW), "supsup-gn"])
def test_a_finished_run_evaluates_again_from_its_folder(tmp_path: Path, case: str) -> None:
    method = case.split("-", maxsplit=1)[0]
    overrides = (
        *TINY,
        *tiny_fit(f"method={method}"),
        f"method={method}",
        "trainer.epochs=1",
        *AGAIN_EXTRA.get(case, ()),
    )
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_config(*overrides), tmp_path / ".hydra" / "config.yaml")
    train(validate(compose_config(*overrides)), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())["acc_matrix"]
    again = reevaluate(tmp_path)
    assert again == {s: saved[s][-1] for s in ("til", "cil")}


def test_reevaluating_a_corrupt_or_foreign_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not a clbench run folder"):
        reevaluate(tmp_path)
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_config(*TINY), tmp_path / ".hydra" / "config.yaml")
    (tmp_path / "method_artifacts.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(DataError, match="corrupt"):
        reevaluate(tmp_path)


@pytest.mark.parametrize("method", baselines_slow([m for m in TRAINED if m != "joint"]))
def test_parameters_outside_the_optimizer_compute_no_gradient(method: str) -> None:
    """Frozen parts (pretrained weights under masks, other tasks' heads, PackNet's and HAT's frozen biases and
    norms after task 0) are left out of autograd: after a real step their .grad is None."""
    from clbench.loop.optim import build_optimizer
    from clbench.loop.resume import finish_untrained
    from clbench.loop.step import train_step

    extra = ("method.retrain_epochs=0",) if method == "packnet" else ()
    cfg = tiny_config(f"method={method}", *extra)
    method_obj, rt = build_runtime(cfg)
    for task in rt.benchmark.tasks[:2]:  # the second task: what task 0 froze stays out
        method_obj.before_task(task)
        training = [p for p in method_obj.phases(task, 1) if not (p.observe or p.memory)]
        if not training:  # a task that only observes (APER's and RanPAC's after the first)
            finish_untrained(method_obj, task)
            continue
        phase = training[0]
        method_obj.before_phase(task, phase)
        optimizer = build_optimizer(method_obj, task, phase, cfg.trainer)
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        method_obj.zero_grad(set_to_none=True)
        x, y = rt.benchmark.train[task.id].batch(None, 0, 8)
        ids = torch.arange(len(y)) if method_obj.takes_ids() else None  # a recorded teacher's rows
        train_step(method_obj, task, rt, x, y, optimizer=optimizer, params=[], ids=ids)
        stray = [n for n, p in method_obj.named_parameters() if id(p) not in trained and p.grad is not None]
        assert not stray, stray[:5]
        finish_untrained(method_obj, task)


@pytest.mark.parametrize("method", baselines_slow(TRAINED))
def test_both_scenarios_from_one_call_equal_separate_predictions(method: str) -> None:
    """Evaluation shares the passes TIL and CIL have in common; the logits are those of two predict calls."""
    cfg = tiny_config(f"method={method}", "trainer.epochs=1")
    method_obj, rt = build_runtime(cfg)
    for task in rt.benchmark.tasks[:2]:
        method_obj.before_task(task)
        run_task(method_obj, task, rt, epochs=1)
        method_obj.after_task(task)
    method_obj.eval()
    x = rt.test_tf(rt.benchmark.test[1].x[:8])
    both = method_obj.predict_scenarios(x, 1, ("til", "cil"))
    assert torch.equal(both["til"], method_obj.predict(x, 1))
    assert torch.equal(both["cil"], method_obj.predict(x, None))
    assert method_obj.predict_scenarios(x, 1, ("til",)).keys() == {"til"}


def test_an_infinite_learning_rate_is_refused_before_any_work() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.lr.*inf.*a finite float > 0"):
        tiny_config("trainer.lr=inf")


def test_soft_targets_that_are_one_hot_give_the_hard_cross_entropy() -> None:
    from clbench.data import Task
    from clbench.methods import Method

    task = Task(1, (7, 8, 9), ("a", "b", "c"), 3)
    logits, y = torch.randn(4, 3), torch.tensor([3, 5, 4, 3])  # global labels of task 1 (offset 3)
    soft = torch.nn.functional.one_hot(y - 3, 3).float()
    assert torch.allclose(Method.task_loss(logits, soft, task), Method.task_loss(logits, y, task))


def test_mixup_and_cutmix_train_methods_with_task_losses_and_are_refused_for_others(tmp_path: Path) -> None:
    deit = ("trainer.mixup=0.8", "trainer.cutmix=1.0", "trainer.label_smoothing=0.1", "data.num_tasks=2")
    results = train(tiny_config("method=meat", "trainer.epochs=1", *deit), tmp_path)
    assert results.status == "finished"
    for method in ("l2p", "finetune", "joint"):
        with pytest.raises(ClbenchError, match=r"`trainer.mixup`/`trainer.cutmix`: 0.8/1.0"):
            build_runtime(tiny_config(f"method={method}", *deit))
    build_runtime(tiny_config("method=finetune", "method.loss_scope=task", *deit))  # CE over the task's classes


def test_throughput_below_one_image_a_second_is_said_in_seconds_an_image() -> None:
    """A ViT-B on a CPU trains 0.3 images/s: "0 images/s" said nothing; 1 / 0.3 = 3.33 s an image does."""
    from clbench.loop.task import throughput

    assert throughput(512.4) == "512 images/s" and throughput(1.0) == "1 image/s"
    assert throughput(0.3) == "3.33 s/image" and throughput(0.05) == "20 s/image"
