"""MkDocs hook: the configuration's key tables, generated from the dataclass schemas when the site is built.

A line ``<!-- config: GROUP -->`` in a page becomes the table of that group's schema (``clbench.config.GROUPS``;
``top`` for the top-level keys of ``RunConfig``), and ``<!-- config: method/NAME -->`` the table of the ``Config``
dataclass of the class that ``conf/method/NAME.yaml`` names, with the values that YAML sets and its trainer recipe
(``method/*``: a section for every method shipped); ``<!-- config: datasets -->`` the table of every dataset read
from files (``clbench.data.catalog``), ``<!-- config: pilot_archives -->`` that of Protocol P's split archives.
Each row is a field: its key, type, default and the comment that documents it in the source (the comment on its
line, after the comment lines right above it), so no key is typed twice by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- config: ([\w/*]+) -->$", re.M)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return MARKER.sub(lambda m: table(m.group(1)), markdown)


def table(name: str) -> str:
    """The Markdown for one marker (an unknown name fails the build)."""
    if sys.path[0] != str(ROOT / "src"):
        sys.path.insert(0, str(ROOT / "src"))  # document the checkout being built, not an installed copy
    from clbench import config

    if name == "method/*":  # every method clbench ships, in the README's order
        from clbench.method_table import method_names

        return "\n\n".join(f"### `method={m}`\n\n{method_table(m)}" for m in method_names())
    if name.startswith("method/"):
        return method_table(name.removeprefix("method/"))
    if name == "datasets":
        return datasets_table()
    if name == "pilot_archives":
        return pilot_archives_table()
    if name == "top":
        skip = {*config.GROUPS, "method", "method_target"}
        return rows(config.RunConfig, "", [f for f in dataclasses.fields(config.RunConfig) if f.name not in skip])
    schema = config.GROUPS[name]
    return rows(schema, f"{name}.", dataclasses.fields(schema))


def datasets_table() -> str:
    """Every dataset clbench reads from files (clbench.data.catalog: the facts its "missing data" message gives)."""
    from clbench.data.catalog import DATASETS

    head = "| name | dataset | get it from | layout under `data.root` | size | `data.download` |\n" + "|---" * 6 + "|"
    lines = [
        f"| `{name}` | {escape(f.title)} | {escape(f.url)} | {code(f.layout)} | {f.size} | "
        f"{'yes' if f.downloads else 'no: copy it by hand'} |"
        for name, f in DATASETS.items()
    ]
    return "\n".join([head, *lines])


def pilot_archives_table() -> str:
    """Protocol P's split archives (clbench.data.catalog.PILOT_ARCHIVES): what the missing-data message names."""
    from clbench.data.catalog import PILOT_ARCHIVES

    head = "| folder | dataset | archive (published MD5) | get it from | layout under `data.root` | images |\n"
    lines = [
        f"| `{name}` | {escape(f.title)} | `{f.archive}` (`{f.md5}`) | {escape(f.url)} | {code(f.layout)} | {f.size} |"
        for name, f in PILOT_ARCHIVES.items()
    ]
    return "\n".join([head + "|---" * 6 + "|", *lines])


def method_table(name: str) -> str:
    """A method's keys (with the values its YAML sets) and the trainer recipe its YAML sets."""
    from hydra.utils import get_class

    text = (ROOT / "conf" / "method" / f"{name}.yaml").read_text()
    recipe = yaml.safe_load(text)
    params = dict(recipe.get("method", {}))
    cls = get_class(params.pop("_target_"))
    doc = cls.Config.__doc__ or ""
    if doc.startswith(f"{cls.Config.__name__}("):  # the signature dataclasses writes where the class has no docstring
        doc = ""
    intro = f"`_target_: {cls.__module__}.{cls.__name__}`" + (f". {' '.join(doc.split())}" if doc else "")
    fields = dataclasses.fields(cls.Config)
    body = rows(cls.Config, "method.", fields, sets=params, yaml_name=f"{name}.yaml", fallback=yaml_comments(text))
    trainer = recipe.get("trainer") or {}
    tail = ", ".join(f"`{k}={literal(v)}`" for k, v in trainer.items())
    return "\n\n".join([intro, body, *([f"Recipe in `conf/method/{name}.yaml`: trainer {tail}."] if tail else [])])


def yaml_comments(text: str) -> dict[str, str]:
    """The comments on the keys of a method YAML's ``method:`` block (with their continuation lines): what documents a
    method's field whose dataclass has no comment for it."""
    out: dict[str, str] = {}
    block, last = False, None
    for line in text.splitlines():
        if not line.startswith(" "):
            block, last = line.startswith("method:"), None
        elif block and (found := re.match(r"^  (\w+):[^#]*#\s*(.*)$", line)):
            last = found.group(1)
            out[last] = found.group(2)
        elif block and last and re.match(r"^\s{3,}#", line):
            out[last] += " " + line.strip().lstrip("#").strip()
        elif block:
            last = None
    return out


def rows(
    schema: type,
    prefix: str,
    fields: Any,
    *,
    sets: dict | None = None,
    yaml_name: str = "",
    fallback: dict | None = None,
) -> str:
    """A Markdown table of ``fields``: key, type, default (and the value a method's YAML sets), description (the
    field's comment, else the YAML's comment on it). A field that holds a dataclass of its own (SLCA's
    ``method.alignment``) gives a row for each of its fields."""
    head = ["key", "type", "default", *([yaml_name] if sets is not None else []), "description"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *field_rows(schema, prefix, fields, sets, fallback)])


def field_rows(schema: type, prefix: str, fields: Any, sets: dict | None, fallback: dict | None) -> list[str]:
    notes = (fallback or {}) | {k: v for k, v in field_comments(schema).items() if v}
    lines = []
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if dataclasses.is_dataclass(default):
            nested = (sets or {}).get(f.name) if sets is not None else None
            inner = dataclasses.fields(default)
            lines += field_rows(
                type(default), f"{prefix}{f.name}.", inner, nested or ({} if sets is not None else None), None
            )
            continue
        shown = "required" if f.default is f.default_factory is dataclasses.MISSING else code(literal(default))
        cells = [key_cell(f"{prefix}{f.name}"), code(str(f.type)), shown]
        if sets is not None:
            cells.append(code(literal(sets[f.name])) if f.name in sets and sets[f.name] != default else "")
        cells.append(escape(notes.get(f.name, "")))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@cache
def field_comments(schema: type) -> dict[str, str]:
    """Each field's documenting comment, from the class (or its dataclass bases) that defines it."""
    out: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if dataclasses.is_dataclass(cls) and cls is not schema:
            out |= field_comments(cls)
    if dataclasses.is_dataclass(schema):
        out |= class_comments(Path(inspect.getsourcefile(schema)), schema.__name__)
    return out


def class_comments(path: Path, name: str) -> dict[str, str]:
    """The comments of class ``name``'s annotated fields in the source file ``path``."""
    source = path.read_text()
    lines = source.splitlines()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        own = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        out[stmt.target.id] = " ".join([*above, *own])
    return out


def literal(value: Any) -> str:
    """A value as it is written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, float) and (abs(value) >= 1e5 or 0 < abs(value) < 1e-3):
        return f"{value:.6g}"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {literal(v)}" for k, v in value.items()) + "}"
    return str(value)


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def key_cell(key: str) -> str:
    """A dotted key as code that breaks only after its dots (``<wbr>``; the stylesheet keeps the rest whole), so that
    ``data.synthetic_train_per_class`` never wraps inside a word."""
    return '<code class="config-key">' + ".<wbr>".join(key.split(".")) + "</code>"


def escape(text: str) -> str:
    """A comment as a table cell: pipes outside code spans escaped."""
    parts = text.split("`")
    return "`".join(p.replace("|", "\\|") if i % 2 == 0 else p for i, p in enumerate(parts))
