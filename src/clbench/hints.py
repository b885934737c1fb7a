"""What a mistyped command line most likely meant, said instead of Hydra's own message where clbench knows better.

Hydra answers ``method.lamda=0.5`` with "To append to your config use +method.lamda=0.5", which clbench's schemas
would refuse anyway, ``method=meta`` with the list of methods alone, and ``lam=0.5`` without a hint. For each,
:func:`explain` names the closest key or option: ``method.lam``, ``method=meat``, ``method.lam``. What Hydra writes
while it composes is held (:class:`HeldStderr`), so that clbench's reading comes instead of it, not after it.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import sys
from typing import ClassVar, TextIO

from hydra.errors import HydraException, MissingConfigException
from hydra.utils import get_class

from clbench.config import GROUPS, closest, config_dir


def explain(error: HydraException, argv: list[str]) -> str | None:
    """One paragraph for a config option or key the command line got wrong, with the closest right one; None where
    there is no likely meaning (Hydra's message then stands)."""
    if isinstance(error, MissingConfigException):
        return missing_option(error)
    full_key = str(getattr(error.__cause__, "full_key", "") or "")
    group, _, key = full_key.rpartition(".")
    if not key:
        return None
    if not group:
        return top_level(key, argv)
    schema = GROUPS.get(group) if group != "method" else chosen_method_config(argv)
    match = closest(key, [f.name for f in dataclasses.fields(schema)]) if schema is not None else None
    chosen = method_of(argv)
    owner = f"the {group} config" if group != "method" else f"method={chosen}" if chosen else "the chosen method"
    return f"`{full_key}` is not a key of {owner}: did you mean `{group}.{match}`?" if match else None


def missing_option(error: MissingConfigException) -> str | None:
    """``method=meta``: the closest option of the group, and the others."""
    group, _, name = str(error.missing_cfg_file or "").rpartition("/")
    options = [str(o) for o in error.options or []]
    match = difflib.get_close_matches(name, options, 1) if group and name else []
    if not match:
        return None
    return f"no {group} config `{name}`: did you mean `{group}={match[0]}`? The {group} configs: {', '.join(options)}."


def top_level(key: str, argv: list[str]) -> str | None:
    """``lam=0.5``: a key that belongs to a group, named as ``group.key``: the chosen method's config first, then the
    other groups, then the other methods' configs (naming the methods that have it)."""
    fields = {f"method.{f.name}": f.name for f in dataclasses.fields(chosen_method_config(argv) or object)}
    fields |= {f"{group}.{f.name}": f.name for group, schema in GROUPS.items() for f in dataclasses.fields(schema)}
    found = best(key, fields)
    if found:
        return f"`{key}` is not a top-level key: did you mean `{found}`?"
    keys = {name: {f.name for f in dataclasses.fields(config)} for name, config in method_configs().items()}
    near = (
        [key]
        if any(key in k for k in keys.values())
        else difflib.get_close_matches(key, sorted(set().union(*keys.values())), 1)
    )
    if not near:
        return None
    owners = ", ".join(f"method={name}" for name, k in keys.items() if near[0] in k)
    return f"`{key}` is not a top-level key: did you mean `method.{near[0]}` (a key of {owners})?"


def method_configs() -> dict[str, type]:
    """Every shipped method's ``Config`` dataclass, by its config's name (conf/method/<name>.yaml)."""
    import yaml

    configs = {}
    for path in sorted((config_dir() / "method").glob("*.yaml")):
        target = ((yaml.safe_load(path.read_text()) or {}).get("method") or {}).get("_target_")
        if target:
            configs[path.stem] = get_class(str(target)).Config
    return configs


def best(key: str, fields: dict[str, str]) -> str | None:
    """The dotted key whose last part is ``key``, else the one whose last part is closest to it."""
    exact = [dotted for dotted, name in fields.items() if name == key]
    near = difflib.get_close_matches(key, list(fields.values()), 1)
    return exact[0] if exact else next((d for d, name in fields.items() if near and name == near[0]), None)


def method_of(argv: list[str]) -> str | None:
    """The method a command line names (``method=meat``), if it names one."""
    return next((a.split("=", 1)[1] for a in argv if a.lstrip("+~").startswith("method=")), None)


CHOICES = (*GROUPS, "method", "experiment", "hparams_search")  # the config groups a command line picks from


def chosen_method_config(argv: list[str]) -> type | None:
    """The ``Config`` dataclass of the method a command line chose (directly or through a preset): the config
    composed again from its group choices and group keys, without the ``method.*`` keys (one of them is the typo).
    None where that cannot be said (a sweep over methods, another error)."""
    from hydra import compose, initialize_config_dir

    overrides = []
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        if "=" in arg and not arg.startswith("-") and (key in CHOICES or key.split(".")[0] in GROUPS):
            overrides.append(arg)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            target = compose("config", overrides=overrides).method._target_
        return get_class(str(target)).Config
    except Exception:  # the command line has another error too, or sweeps the method: no suggestion
        return None


class HeldStderr(io.StringIO):
    """What is written to stderr while Hydra composes the config, held until the job or sweep starts (:meth:`release`,
    called by ``clbench.cli.app`` and at a sweep's start) or Hydra gives up: clbench's reading of a mistyped key or
    option (:func:`explain`) then replaces Hydra's."""

    real: ClassVar[TextIO | None] = None

    @classmethod
    def hold(cls) -> HeldStderr:
        held = cls()
        cls.real, sys.stderr = sys.stderr, held
        return held

    @classmethod
    def release(cls, instead: str | None = None) -> None:
        """Write what was held (or ``instead`` of it) to the real stderr and stop holding. Where nothing is held any
        more (Hydra composed a later job of a sweep after the first had started), ``instead`` follows what Hydra
        said."""
        held, real = sys.stderr, cls.real
        if real is None or not isinstance(held, cls):
            if instead:
                print(instead, end="", file=sys.stderr)
            return
        sys.stderr, cls.real = real, None
        real.write(held.getvalue() if instead is None else instead)
        real.flush()
