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
    "data.split_lists": None,
    "data.init_classes": None,
    "data.increment": None,
    "data.brightness": 0.0,
    "trainer.drop_last": False,
    "method.decay_old_heads": False,  # TUNA
    "method.proto_groups": 1,  # HiDe
    "backbone.input_mean": None,
    "backbone.input_std": None,
}

# The keys that say what a run was measured on: the benchmark's tasks (its source, which classes, in which order, how
# many, how they are cut into tasks), the train/test split and the classes CIL's argmax runs over; a key a data config
# does not have is left out. Runs that differ in one of them were measured on
# different things: a report never sets their rows side by side without saying so, a method or paper table never mixes
# them. (``data.num_tasks`` counts as the number of tasks run: null and the benchmark's own count are one protocol.)
PROTOCOL = (
    "data.name",
    "data.protocol",
    "data.source",
    "data.folder",
    "data.datasets",
    "data.tasks",
    "data.num_tasks",
    "data.init_classes",
    "data.increment",
    "data.tasks_by",
    "data.class_order_seed",
    "data.permutation_seed",
    "data.permutation_size",
    "data.split_seed",
    "data.test_fraction",
    "data.folder_split",
    "data.split_lists",
    "data.synthetic_classes",
    "data.synthetic_train_per_class",
    "data.synthetic_test_per_class",
    "data.synthetic_image_size",
    "data.synthetic_channels",
    "trainer.cil_classes",
)
# Where a run recorded the SHA-256 of the weights it loaded, the hash is the setting, not the path nor the flag that
# found the file: the same file under two paths is one setting, two files under one path are two.
WEIGHTS_SOURCE = ("backbone.weights", "backbone.pretrained")
WEIGHTS_HASH = "backbone.weights_sha256"


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


def setting(config: Mapping[str, Any], weights_sha256: str | None = None) -> dict[str, Any]:
    """The flattened config less the seed, the keys in :data:`NOT_A_SETTING` and those of :data:`LATER_KEYS` at their
    old behaviour's value: what makes two runs comparable. With ``weights_sha256`` (the hash of the weights the run
    loaded) the hash replaces :data:`WEIGHTS_SOURCE`."""
    flat = {k: v for k, v in flatten(config).items() if is_setting(k) and not (k in LATER_KEYS and v == LATER_KEYS[k])}
    if weights_sha256:
        flat = {k: v for k, v in flat.items() if k not in WEIGHTS_SOURCE} | {WEIGHTS_HASH: weights_sha256}
    return dict(sorted(flat.items()))


def config_of(run: Mapping[str, Any]) -> dict[str, Any]:
    """A results.json's resolved config; for an older one without it, what its header tells."""
    if "config" in run:
        return dict(run["config"])
    backbone = {k: v for k, v in run.get("backbone_config", {}).items() if k not in ("weights_file", "weights_sha256")}
    return {
        "method": {"_target_": run["method"], **run.get("method_config", {})},
        "backbone": backbone,
        "data": {"name": run["benchmark"]},
    }


def run_setting(run: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`setting` of a results.json: its config, the weights it loaded standing for where they came from."""
    recorded = run.get("backbone_config")
    sha = recorded.get("weights_sha256") if isinstance(recorded, Mapping) else None
    return setting(config_of(run), sha if isinstance(sha, str) else None)


def setting_key(run: Mapping[str, Any]) -> str:
    """:func:`run_setting` as one string (canonical JSON): runs of one setting share it."""
    return json.dumps(run_setting(run), sort_keys=True, default=str)


def setting_hash(config: Mapping[str, Any], length: int = 8, weights_sha256: str | None = None) -> str:
    """A short, stable hash of :func:`setting` (canonical JSON, SHA-256)."""
    text = json.dumps(setting(config, weights_sha256), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def is_protocol(key: str) -> bool:
    """Whether a flattened key is one of :data:`PROTOCOL`."""
    return key in PROTOCOL


def protocol(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`PROTOCOL` keys of a config's :func:`setting` (``data.num_tasks``: the number of tasks run)."""
    flat = setting(config)
    found = {k: flat[k] for k in PROTOCOL if k in flat}
    if "data.num_tasks" in found or "data.tasks" in flat:
        found["data.num_tasks"] = found.get("data.num_tasks") or flat.get("data.tasks")
    return found


def benchmark_label(data: Mapping[str, Any]) -> str:
    """What a run measured, as a name: the data config's name, with ``_first<N>`` where ``data.num_tasks`` keeps only
    the first N of its tasks (``digits_5tasks_first3``). Folder names, results.json, reports and titles use it."""
    name, tasks, kept = data.get("name", "data"), data.get("tasks"), data.get("num_tasks")
    cut = isinstance(kept, int) and isinstance(tasks, int) and kept < tasks
    return f"{name}_first{kept}" if cut else str(name)


def method_name(target: str) -> str:
    """A method's name from its ``_target_``: its module's, as its config's (conf/method/<name>.yaml).

    ``clbench.methods.coda_prompt.CODAPrompt`` -> ``coda_prompt``; a bare class name lower-cased.
    """
    module, _, cls = target.rpartition(".")
    return module.rpartition(".")[2] or cls.lower()


def setting_name(config: Mapping[str, Any], weights_sha256: str | None = None) -> str:
    """A readable name for a setting: ``<method>-<benchmark>-<backbone>-<hash>``, e.g. W&B's group."""
    method = method_name(str(config.get("method", {}).get("_target_", "method")))
    data = benchmark_label(config.get("data", {}))
    backbone = config.get("backbone", {}).get("name", "backbone")
    return f"{method}-{data}-{backbone}-{setting_hash(config, weights_sha256=weights_sha256)}"


def differing_keys(settings: Iterable[Mapping[str, Any]]) -> list[str]:
    """The keys whose values are not the same in every flattened setting (a key missing from one counts)."""
    settings = list(settings)
    keys = sorted(set().union(*settings)) if settings else []
    return [k for k in keys if len({json.dumps(s.get(k, "<unset>"), default=str) for s in settings}) > 1]


def compact(value: Any) -> str:
    """A setting's value as a user would type it: floats with ``:g``, strings bare, the rest as JSON."""
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else json.dumps(value, default=str)


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
