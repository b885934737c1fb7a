"""Every config group composes and validates; bad values are rejected with the key, value and choices."""

from __future__ import annotations

import copy

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from clbench.config import config_dir, validate
from clbench.errors import ConfigError
from conftest import compose_config, tiny_config


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["data", "backbone", "trainer", "logger", "method", "experiment", "hparams_search"])
def test_every_group_option_composes_and_validates(group: str) -> None:
    assert options(group), f"no options in conf/{group}"
    for name in options(group):
        pilot = group == "data" and "_b0inc" in name  # Protocol P: PILOT's pipeline, a 224 px ViT fed [0, 1] pixels
        run_cfg = validate(compose_config(f"{group}={name}", *(["backbone=vit_base_patch16_224_augreg_in21k"] * pilot)))
        assert run_cfg.trainer.epochs >= 0


def test_default_is_the_embedded_benchmark() -> None:
    cfg = validate(compose_config())
    assert (cfg.data.name, cfg.backbone.name, cfg.method_target) == (
        "digits_5tasks",
        "vit_micro",
        "clbench.methods.finetune.Finetune",
    )
    assert cfg.data.class_order_seed == 1993 and cfg.seed == 0
    assert cfg.logger.mode == "offline" and cfg.trainer.device == "auto"


def test_method_recipe_overrides_trainer_defaults_and_cli_overrides_both() -> None:
    assert compose_config("method=joint").trainer.grad_clip == 1.0
    assert compose_config("method=joint", "trainer.grad_clip=2.5").trainer.grad_clip == 2.5


CIFAR_STATS = ("backbone.input_mean=[0.5071,0.4867,0.4408]", "backbone.input_std=[0.2675,0.2565,0.2761]")


def test_own_input_statistics_normalise_the_pixels_and_are_recorded() -> None:
    """A code that normalises with its dataset's statistics (HiDe's CIFAR pipeline): the run's transforms take them in
    place of the weights'; a bad pair is refused, naming the key."""
    from clbench.loop.runtime import build_runtime

    _, rt = build_runtime(tiny_config("backbone.normalize=true", *CIFAR_STATS))
    assert rt.test_tf.mean.flatten().tolist() == pytest.approx([0.5071, 0.4867, 0.4408])
    assert rt.train_tf.std.flatten().tolist() == pytest.approx([0.2675, 0.2565, 0.2761])
    for overrides, key in (
        (CIFAR_STATS[:1], "backbone.input_std"),
        (("backbone.normalize=false", *CIFAR_STATS), "backbone.normalize"),
        (("backbone.input_mean=[0.5,0.5]", CIFAR_STATS[1]), "backbone.input_mean"),
        ((CIFAR_STATS[0], "backbone.input_std=[0.2,0.0,0.2]"), "backbone.input_std"),
    ):
        with pytest.raises(ConfigError, match=f"`{key}`"):
            validate(compose_config("backbone.normalize=true", *overrides))


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("trainer.epochs=-1", "trainer.epochs", "an integer >= 0"),
        ("trainer.device=tpu", "trainer.device", "auto, cpu, cuda"),
        ("trainer.precision=fp8", "trainer.precision", "auto, bf16, fp32"),
        ("trainer.lr=0", "trainer.lr", "> 0"),
        ("trainer.optimizer=lion", "trainer.optimizer", "adamw, adam, sgd"),
        ("logger.mode=loud", "logger.mode", "offline, online, disabled"),
        ("data.num_tasks=9", "data.num_tasks", "[1, data.tasks=5]"),
        ("data.train_crop=zoom", "data.train_crop", "pad, resized, none"),
        ("backbone.weights=model.txt", "backbone.weights", ".safetensors"),
        ("method.loss_scope=all", "method.loss_scope", "seen, task"),
        ("objective=cil.accuracy", "objective", "<til|cil>.<final_acc|"),
        ("objective=final_acc", "objective", "<til|cil>."),
        ("resume=maybe", "resume", "true, false or auto"),
    ],
)
def test_bad_values_are_rejected_with_key_value_and_choices(override: str, key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(override))
    message = str(err.value)
    assert f"`{key}`" in message and allowed in message
    assert override.split("=", 1)[1] in message


def test_wrong_type_is_refused_while_composing_and_names_the_key() -> None:
    with pytest.raises(ConfigCompositionException, match=r"trainer\.epochs=many") as err:
        compose_config("trainer.epochs=many")
    assert "trainer.epochs" in str(err.value.__cause__)


def test_every_schema_field_is_overridable_even_when_a_yaml_does_not_list_it() -> None:
    cfg = validate(compose_config("data=digits_5tasks", "data.crop_padding=2", "trainer.compile=true"))
    assert cfg.data.crop_padding == 2 and cfg.trainer.compile is True


def test_unknown_method_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"method.*no_such_knob"):
        validate(compose_config("+method.no_such_knob=1"))


def test_unknown_top_level_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match="typo_key"):
        validate(compose_config("+typo_key=1"))


def test_missing_method_target_is_rejected() -> None:
    cfg = compose_config()
    cfg.method = DictConfig({"loss_scope": "seen"})
    with pytest.raises(ConfigError, match="_target_"):
        validate(cfg)


def test_the_loop_does_not_import_the_cli() -> None:
    """The config directory lives below both (clbench.config): the training loop imports no command-line module."""
    import subprocess
    import sys

    code = "import sys, clbench.loop, clbench.loop.runtime; sys.exit('clbench.cli' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_every_method_float_must_be_finite() -> None:
    """One rule for every method's Config: `method=ksm method.alpha=inf` (and DualPrompt's pull, CODA-Prompt's
    ortho_mu) trained to NaN and then blamed the learning rate; `method.temperature=inf` trained a 0.5 mask
    everywhere without a word. No method field gives inf a meaning, so each float field refuses inf and nan."""
    import dataclasses

    from hydra.utils import get_class

    checked = []
    for method in options("method"):
        composed = compose_config(f"method={method}")  # once a method; each value set as `++method.NAME=VALUE` sets it
        fields = dataclasses.fields(get_class(composed.method._target_).Config)
        for field in (f for f in fields if "float" in str(f.type)):
            for value in ("inf", "-inf", "nan"):
                cfg = copy.deepcopy(composed)
                OmegaConf.update(cfg, f"method.{field.name}", float(value), force_add=True)
                with pytest.raises(ConfigError, match=rf"`method\.{field.name}`: .*{value}"):
                    validate(cfg)
                checked.append(f"{method}.{field.name}")
    assert {"ksm.alpha", "ksm.temperature", "dualprompt.pull", "coda_prompt.ortho_mu"} <= set(checked)


def test_a_field_may_allow_inf_but_never_nan() -> None:
    import dataclasses
    import math

    from clbench.config import require_finite

    @dataclasses.dataclass
    class Config:
        cap: float = dataclasses.field(default=math.inf, metadata={"allow_inf": True})
        scale: list[float] = dataclasses.field(default_factory=lambda: [1.0, 2.0])

    require_finite(Config(), "method")
    with pytest.raises(ConfigError, match=r"`method\.cap`: nan\. Allowed: a finite float or inf"):
        require_finite(Config(cap=math.nan), "method")
    with pytest.raises(ConfigError, match=r"`method\.scale`: \[1\.0, inf\]\. Allowed: a finite float"):
        require_finite(Config(scale=[1.0, math.inf]), "method")
