"""Property test: random overrides either build a runnable setup or end in a ClbenchError naming the key."""

from __future__ import annotations

from typing import Any

import torch
from hydra.errors import ConfigCompositionException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clbench.config import validate
from clbench.errors import ClbenchError
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from conftest import TINY, compose_config

METHOD_KEYS = {
    "finetune": ["loss_scope", "freeze_backbone"],
    "joint": [],
    "packnet": ["prune_ratio", "retrain_epochs"],
    "piggyback": ["threshold", "init_scale", "mask_init", "mask_lr"],
    "supsup": [
        "density",
        "er_scale",
        "base_weights",
        "inference",
        "mask_lr",
        "head",
        "outputs",
        "mask_rule",
        "objective",
    ],
    "hat": ["s_max", "c", "thres_cosh", "thres_emb", "units"],
    "meat": ["gamma", "alpha", "lam", "tau", "init", "token_mask_layers", "mask_lr"],
    "l2p": ["pool_size", "top_n", "prompt_length", "pull", "layout", "diversify", "batchwise_prompt"],
    "dualprompt": ["g_length", "e_length", "top_k", "pull", "prefix", "shared_prompt_pool", "batchwise_prompt"],
    "coda_prompt": ["pool_size", "length", "layers", "ortho_mu", "init"],
    "apd": [
        "l1",
        "drift",
        "wd",
        "mask_l1",
        "e_gap",
        "every",
        "k_centroids",
        "init",
        "mask_init",
        "old_masks",
        "kmeans",
        "grad_scale",
        "others",
    ],
    "ctr": ["s_max", "c", "anneal", "adapter_size", "channels", "ksm", "ksm_lr", "ks_gate"],
    "ksm": ["temperature", "alpha", "init", "group", "mask_lr"],
    "tfm": ["growth", "reuse"],
}
COMMON_KEYS = [
    "trainer.epochs",
    "trainer.batch_size",
    "trainer.lr",
    "trainer.optimizer",
    "trainer.precision",
    "trainer.grad_clip",
    "trainer.warmup_epochs",
    "trainer.schedule",
    "data.num_tasks",
    "data.train_crop",
    "data.crop_padding",
    "seed",
    "objective",
]
VALUES = st.one_of(
    st.integers(-3, 12),
    st.floats(-1.5, 2.5, allow_nan=False).map(lambda v: round(v, 3)),
    st.booleans(),
    st.none(),
    st.sampled_from(
        [
            "abc",
            "til.final_acc",
            "cil.bwt",
            "seen",
            "keep",
            "uniform",
            "sgd",
            "adam",
            "bf16",
            "fp32",
            "frequency",
            "[0]",
            "[mlp,qkv]",
        ]
    ),
)


def hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    method = draw(st.sampled_from(sorted(METHOD_KEYS)))
    keys = draw(st.lists(st.sampled_from([f"method.{k}" for k in METHOD_KEYS[method]] + COMMON_KEYS), max_size=3))
    return [f"method={method}", *[f"{k}={hydra_value(draw(VALUES))}" for k in dict.fromkeys(keys)]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides())
def test_random_overrides_run_or_fail_with_a_clear_message(extra: list[str]) -> None:
    try:
        cfg = validate(compose_config(*TINY, "trainer.eval_random_init=false", *extra))
        method, rt = build_runtime(cfg)
    except ConfigCompositionException as err:  # a value of the wrong type, refused by Hydra naming the key
        assert "full_key" in str(err.__cause__), str(err.__cause__)
        return
    except ClbenchError as err:
        assert "`" in str(err) and ("Allowed" in str(err) or "Invalid" in str(err)), str(err)
        return
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    cfg.trainer.epochs = min(cfg.trainer.epochs, 1)
    run_task(method, task, rt, epochs=cfg.trainer.epochs)
    method.after_task(task)
    acc = rt.evaluate(method, [0])
    assert all(0 <= a <= 100 for values in acc.accuracy.values() for a in values)
    assert all(torch.isfinite(p).all() for p in method.parameters())
