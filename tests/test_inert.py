"""Settings that change nothing are said at a run's start; sweep job folders are named by what they vary."""

from __future__ import annotations

import pytest

from clbench.inert import inert_settings, overridden_keys
from clbench.loop.optim import lr_factor
from clbench.methods.meat import MEAT
from clbench.sweep_folders import SWEPT_ENV, job_folder, remember_swept
from conftest import tiny_config


def test_a_warm_up_covering_every_epoch_is_said_with_the_share_of_the_lr_it_reaches() -> None:
    cfg = tiny_config("trainer.epochs=1", "trainer.warmup_epochs=5")
    per_epoch = 4  # any: the warm-up ramps over round(5 * per_epoch) steps, the task ends after per_epoch of them
    last = lr_factor(per_epoch - 1, per_epoch, 5 * per_epoch, cfg.trainer, per_epoch)
    (line,) = inert_settings(cfg, set(), {})
    assert f"at {last:.0%} of trainer.lr" in line and "20%" in line
    assert inert_settings(tiny_config("trainer.epochs=5", "trainer.warmup_epochs=1"), set(), {}) == []


@pytest.mark.parametrize(
    ("overrides", "key", "because"),
    [
        (("trainer.optimizer=adamw", "trainer.momentum=0.5"), "trainer.momentum", "trainer.optimizer=adamw"),
        (("trainer.schedule=cosine", "trainer.lr_decay=0.9"), "trainer.lr_decay", "trainer.schedule=cosine"),
        (("trainer.schedule=cosine", "trainer.milestones=[3]"), "trainer.milestones", "trainer.schedule=cosine"),
        (
            ("trainer.schedule=constant", "trainer.cosine_epochs=3"),
            "trainer.cosine_epochs",
            "trainer.schedule=constant",
        ),
        (("data.train_crop=none", "data.crop_padding=2"), "data.crop_padding", "data.train_crop=none"),
        (("trainer.label_smoothing=0.1",), "trainer.label_smoothing", "trainer.mixup=0.0 and trainer.cutmix=0.0"),
        (("data.folder_split=own", "data.split_seed=3"), "data.split_seed", "data.folder_split=own"),
    ],
)
def test_a_key_set_where_another_setting_makes_it_unused_is_said(
    overrides: tuple[str, ...], key: str, because: str
) -> None:
    cfg = tiny_config(*overrides)
    assert inert_settings(cfg, overridden_keys(list(overrides)), {}) == [
        f"{key} is set but changes nothing with {because}."
    ]
    assert inert_settings(cfg, set(), {}) == []  # left at its default: nothing to say


def test_the_same_keys_in_use_are_not_said() -> None:
    overrides = [
        "trainer.optimizer=sgd",
        "trainer.momentum=0.5",
        "trainer.schedule=exponential",
        "trainer.lr_decay=0.9",
    ]
    assert inert_settings(tiny_config(*overrides), overridden_keys(overrides), {}) == []
    multistep = ["trainer.schedule=multistep", "trainer.milestones=[1]", "trainer.lr_decay=0.1"]
    assert inert_settings(tiny_config(*multistep), overridden_keys(multistep), {}) == []


def test_meat_says_lam_is_unused_without_its_drop_control_term() -> None:
    inert = MEAT.unused_keys(tiny_config("method=meat", "method.alpha=0").method)
    assert inert == {"method.lam": "method.alpha=0 (no drop-control term)"}
    assert MEAT.unused_keys(tiny_config("method=meat").method) == {}
    cfg = tiny_config("method=meat", "method.alpha=0", "trainer.warmup_epochs=0")  # MEAT's 5 would cover TINY's 2
    line = inert_settings(cfg, {"method.lam"}, inert)
    assert line == ["method.lam is set but changes nothing with method.alpha=0 (no drop-control term)."]


def test_sweep_job_folders_name_the_swept_overrides_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWEPT_ENV, raising=False)
    remember_swept(["method=meat", "method.lam=0.5,0.9", "experiment=glob(l2p_table1_*)", "+x=range(3)"], ["seed"])
    job = ["method=meat", "method.lam=0.9", "experiment=l2p_table1_ewc", "+x=2", "data.root=/a/b", "seed=1"]
    assert job_folder(3, job) == "3_method.lam=0.9,experiment=l2p_table1_ewc,+x=2,seed=1"
    remember_swept(["data.root=/a/b,/c/d"], [])
    assert job_folder(0, ["data.root=/a/b"]) == "0_data.root=-a-b"  # one folder, never nested
    remember_swept(["method.lam=" + ",".join(["0.5" * 40, "0.9"])], [])
    assert len(job_folder(12, ["method.lam=" + "0.5" * 40])) == len("12_") + 120
    remember_swept(["seed=1"], [])  # nothing swept: the number alone
    assert job_folder(0, ["seed=1"]) == "0"
