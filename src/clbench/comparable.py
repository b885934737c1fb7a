"""When two runs may be averaged: their whole configs are equal except for the seed (clbench's rule: runs are
comparable only then). One definition serves ``clbench-report``'s rows and the W&B group, so the two never disagree.
Free of torch and hydra: the report imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

# Keys that cannot change a run's numbers: where it runs and logs, how often it reports, checkpoints and decodes,
# what a sweeper reads from it. Everything else, the seed aside, sets a run apart.
NOT_A_SETTING = (
    "seed",
    "resume",
    "objective",
    "objective_on_test",
    "logger",
    "trainer.log_every",
    "trainer.checkpoint_every",
    "trainer.eval_batch_size",
    "trainer.compile",  # compiled and eager steps agree to floating-point rounding (tests/test_acceleration.py)
    "trainer.cuda_graphs",
    "data.root",
    "data.download",
    "data.verify_checksums",
    "data.decode_workers",
    "data.store",  # the same accuracy matrices from memory or from the on-disk cache (tests/test_stream.py)
    "data.cache_dir",
    "data.stream_workers",
)


# Keys added to the config after runs were recorded, with the value that reproduces those runs: at that value a key is
# left out of the setting, so a results.json written before it and a new run of the same setting stay one row and one
# W&B group; any other value (data.protocol=P) sets a run apart.
LATER_KEYS: dict[str, Any] = {
    "data.protocol": "clbench",
    "data.transforms": "clbench",
    "data.folder_split": "auto",
    "data.init_classes": None,
    "data.increment": None,
}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"lr": 0.001}}`` -> ``{"trainer.lr": 0.001}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


def is_setting(key: str) -> bool:
    """Whether a flattened key (``trainer.lr``) can change a run's numbers: not one of :data:`NOT_A_SETTING`."""
    return not any(key == skip or key.startswith(f"{skip}.") for skip in NOT_A_SETTING)


def setting(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened config less the seed, the keys in :data:`NOT_A_SETTING` and those of :data:`LATER_KEYS` at their
    old behaviour's value: what makes two runs comparable."""
    flat = sorted(flatten(config).items())
    return {k: v for k, v in flat if is_setting(k) and not (k in LATER_KEYS and v == LATER_KEYS[k])}


def setting_hash(config: Mapping[str, Any], length: int = 8) -> str:
    """A short, stable hash of :func:`setting` (canonical JSON, SHA-256)."""
    text = json.dumps(setting(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def method_name(target: str) -> str:
    """A method's name from its ``_target_``: its module's, as its config's (conf/method/<name>.yaml).

    ``clbench.methods.coda_prompt.CODAPrompt`` -> ``coda_prompt``; a bare class name lower-cased.
    """
    module, _, cls = target.rpartition(".")
    return module.rpartition(".")[2] or cls.lower()


def setting_name(config: Mapping[str, Any]) -> str:
    """A readable name for a setting: ``<method>-<benchmark>-<backbone>-<hash>``, e.g. W&B's group."""
    method = method_name(str(config.get("method", {}).get("_target_", "method")))
    data = config.get("data", {}).get("name", "data")
    backbone = config.get("backbone", {}).get("name", "backbone")
    return f"{method}-{data}-{backbone}-{setting_hash(config)}"


def differing_keys(configs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The setting keys whose values are not the same in every config (a key missing from one counts)."""
    settings = [setting(c) for c in configs]
    keys = sorted(set().union(*settings)) if settings else []
    return [k for k in keys if len({json.dumps(s.get(k, "<unset>"), default=str) for s in settings}) > 1]


def short_names(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its shortest suffix that no other key in ``keys`` ends with (``trainer.lr`` -> ``lr``)."""
    names = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(other != key and (other == suffix or other.endswith(f".{suffix}")) for other in keys):
                break
        names[key] = suffix
    return names
