"""`clbench-report --table NAME PATH...`: the runs under PATH laid out as a paper's table, beside its published numbers.

A table is a data file shipped with clbench (clbench/tables/<name>.yaml): the paper's rows in its order, each with
the label the paper prints, the preset that reproduces it (conf/experiment/<preset>.yaml) and its published numbers,
and per column (metric) what it reads from a run's results.json. The numbers are typed once, there, with their
citation; nothing here knows a paper.

Which row a run is: the experiment preset its Hydra job was composed from, as Hydra recorded it in the job folder
(.hydra/overrides.yaml, else .hydra/hydra.yaml's runtime.choices). A run whose preset is not one of the table's rows,
or that overrides a setting on top of its row's preset (anything but the seed and the keys that cannot change the
numbers, clbench.comparable), is listed apart, never averaged into a row; so is a row's run whose config differs from
that row's other runs (the row keeps its largest group of equal configs).

Per row and column: clbench's mean ± sample std over the row's runs (seeds), the published number (± its std where
the paper prints one) and the difference clbench − paper; empty where the row was not run, "n/m" where clbench does not
measure the column, "–" where the paper prints none. Rows of reconstructed methods (results.json ``reconstructed``)
are marked with †.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from clbench.comparable import differing_keys, is_setting, run_setting, setting_key
from clbench.errors import ConfigError
from clbench.metrics import NAMES, parse_objective

TABLES = Path(__file__).resolve().parent / "tables"
Run = dict[str, Any]
FOLDER = "_folder"  # where clbench.report.load records a run's folder in its dict
READERS = ("metrics", "final", "storage")


@dataclass(frozen=True)
class Column:
    """One metric of the table: its key in the data file, the paper's label, and what it reads (None: unmeasured)."""

    key: str
    label: str
    reads: str | None
    better: str = "higher"


@dataclass(frozen=True)
class PaperRow:
    label: str
    preset: str | None
    buffer: str | None
    published: dict[str, tuple[float, float | None] | None]


@dataclass(frozen=True)
class PaperTable:
    name: str
    title: str
    citation: str
    multirun: str
    columns: list[Column]
    rows: list[PaperRow]
    notes: list[str] = field(default_factory=list)


@dataclass
class Apart:
    """A run that is not averaged into a row of the table, and why."""

    folder: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.folder}: {self.reason}"


def known_tables() -> list[str]:
    return sorted(p.stem for p in TABLES.glob("*.yaml"))


def load_table(name: str) -> PaperTable:
    """The table ``name`` from clbench/tables; a :class:`ConfigError` naming the known ones if there is none."""
    path = TABLES / f"{name}.yaml"
    if name not in known_tables():
        raise ConfigError(f"Unknown table {name!r} for --table. Known tables: {', '.join(known_tables())}.")
    data = yaml.safe_load(path.read_text())
    columns = [Column(c["key"], c["label"], c.get("reads"), c.get("better", "higher")) for c in data["metrics"]]
    for column in columns:
        if column.reads is not None and column.reads.split(".")[0] not in READERS:
            raise ValueError(f"{path}: metric {column.key} reads {column.reads!r}: not one of {', '.join(READERS)}")
        if column.reads and column.reads.startswith("metrics.") and parse_objective(column.reads[8:]) is None:
            raise ValueError(  # metrics.<til|cil>.<name>: a name results.json's metrics hold
                f"{path}: metric {column.key} reads {column.reads!r}: not metrics.<til|cil>.<{'|'.join(NAMES)}>"
            )
    rows = []
    for row in data["rows"]:
        published = {
            c.key: None if (v := row["published"].get(c.key)) is None else (float(v[0]), float(v[1]) if v[1:] else None)
            for c in columns
        }
        buffer = row.get("buffer")
        rows.append(PaperRow(str(row["label"]), row.get("preset"), None if buffer is None else str(buffer), published))
    return PaperTable(
        data["name"],
        data["title"],
        " ".join(data["citation"].split()),
        data.get("multirun", ""),
        columns,
        rows,
        [" ".join(n.split()) for n in data.get("notes", [])],
    )


# ----------------------------------------------------------------------------------------------------- row identity
def hydra_overrides(folder: Path) -> list[str]:
    try:
        loaded = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in loaded] if isinstance(loaded, list) else []


def hydra_choice(folder: Path, group: str) -> str | None:
    """The option of ``group`` Hydra composed the job from (.hydra/hydra.yaml runtime.choices), if recorded."""
    try:
        hydra = yaml.safe_load((folder / ".hydra" / "hydra.yaml").read_text())
        choice = hydra["hydra"]["runtime"]["choices"].get(group)
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None
    return None if choice in (None, "null") else str(choice)


# Overrides of a row's preset that are judged by what they loaded, not by how they are spelled: the weights file's
# SHA-256 (results.json records it) says whether a run used the row's weights, whatever the path.
BY_HASH = ("backbone.weights",)


def job_preset(folder: Path) -> tuple[str | None, list[str], list[str]]:
    """The experiment preset of the job in ``folder``, its other overrides that can change the numbers, and those of
    them judged by the file they loaded (:data:`BY_HASH`)."""
    preset, extra, by_hash = None, [], []
    for override in hydra_overrides(folder):
        key, _, value = override.lstrip("+~").partition("=")
        if key == "experiment":
            preset = value
        elif key in BY_HASH:
            by_hash.append(override)
        elif not key.startswith(("hydra.", "hydra/")) and key != "hydra" and is_setting(key):
            extra.append(override)
    return preset or hydra_choice(folder, "experiment"), extra, by_hash


def weights_sha(run: Run) -> str | None:
    recorded = run.get("backbone_config")
    sha = recorded.get("weights_sha256") if isinstance(recorded, dict) else None
    return sha if isinstance(sha, str) else None


def why_apart(table: PaperTable, run: Run, presets: set[str]) -> tuple[str | None, str | None, list[str]]:
    """The run's row preset, or why it is not a row's run; and its overrides judged by their hash, with the hash."""
    preset, extra, by_hash = job_preset(Path(run.get(FOLDER, ".")))
    if preset not in presets:
        named = f"experiment={preset}" if preset else "no experiment preset recorded in .hydra/"
        return None, f"not a row of {table.name} ({named})", []
    if extra:
        return None, f"row preset {preset} with other settings: {' '.join(extra)}", []
    if not isinstance(run.get("config"), dict):
        return None, "results.json has no `config`: whether the run matches its row's preset cannot be checked", []
    if by_hash and weights_sha(run) is None:
        return None, f"row preset {preset} with {' '.join(by_hash)}, and no SHA-256 of the weights it loaded", []
    sha = weights_sha(run)
    return preset, None, [f"{o} (SHA-256 {sha[:12]}...)" for o in by_hash if sha]


def place(table: PaperTable, runs: list[Run]) -> tuple[dict[str, list[Run]], list[Apart], dict[str, list[str]]]:
    """The runs of each preset row (one setting each: weights counted by their hash), the runs listed apart with the
    reason, and per row the overrides of its preset its runs were made with."""
    presets = {r.preset for r in table.rows if r.preset}
    by_preset: dict[str, list[tuple[Run, list[str]]]] = defaultdict(list)
    apart = []
    for run in runs:
        preset, reason, hashed = why_apart(table, run, presets)
        if preset is None:
            apart.append(Apart(Path(run.get(FOLDER, ".")), str(reason)))
        else:
            by_preset[preset].append((run, hashed))
    rows, overrides = {}, {}
    for preset, members in by_preset.items():
        groups: dict[str, list[tuple[Run, list[str]]]] = defaultdict(list)
        for member in members:
            groups[setting_key(member[0])].append(member)
        # the largest group of one setting is the row; between equals, the one made without overrides of the preset
        ranked = sorted(groups.values(), key=lambda g: (len(g), not any(h for _, h in g)), reverse=True)
        rows[preset] = [run for run, _ in ranked[0]]
        overrides[preset] = sorted({o for _, hashed in ranked[0] for o in hashed})
        for other in ranked[1:]:
            keys = differing_keys([run_setting(ranked[0][0][0]), run_setting(other[0][0])])
            reason = (
                f"row preset {preset}, but a different setting from its {len(ranked[0])} other runs ({', '.join(keys)})"
            )
            apart += [Apart(Path(r.get(FOLDER, ".")), reason) for r, _ in other]
    return rows, sorted(apart, key=lambda a: str(a.folder)), overrides


# ------------------------------------------------------------------------------------------------------- the values
def backbone_params(backbone: dict[str, Any]) -> int | None:
    """The backbone's parameter count, built on the meta device from its config (no weights, no memory)."""
    try:
        import timm
        import torch

        kwargs = {"num_classes": 0, "img_size": backbone["img_size"], **backbone.get("kwargs", {})}
        with torch.device("meta"):
            model = timm.create_model(backbone["model"], pretrained=False, **kwargs)
        return sum(p.numel() for p in model.parameters())
    except Exception:
        return None


def storage_mb(run: Run) -> float | None:
    """The whole stored model in MB (10^6 bytes): the fp32 backbone once, plus every bit results.json's storage lists
    (per task and shared)."""
    storage, backbone = run.get("storage") or {}, run.get("config", {}).get("backbone") or run.get("backbone_config")
    params = backbone_params(backbone) if backbone else None
    if params is None or "bits_per_task" not in storage:
        return None
    bits = 32 * params + sum(
        v for task in storage["bits_per_task"] for v in task.values() if isinstance(v, int | float)
    )
    bits += sum(v for v in (storage.get("shared_bits") or {}).values() if isinstance(v, int | float))
    return bits / 8 / 1e6


def read(run: Run, reads: str | None) -> float | None:
    """What ``reads`` names in a run: ``metrics.<scenario>.<metric>``, ``final.<scenario>.<dataset>`` (the last
    accuracy-matrix row at the task whose classes come from that dataset), ``storage.mb``."""
    if reads is None:
        return None
    kind, _, rest = reads.partition(".")
    if kind == "metrics":
        scenario, metric = rest.split(".")
        return run["metrics"].get(scenario, {}).get(metric)
    if kind == "final":
        scenario, dataset = rest.split(".")
        for j, task in enumerate(run.get("tasks", [])):
            names = task.get("class_names") or []
            if names and all(str(n).startswith(f"{dataset}/") for n in names):
                return run["acc_matrix"][scenario][-1][j]
        return None
    return storage_mb(run)


def mean_std(values: list[float]) -> tuple[float, float | None]:
    from statistics import fmean, stdev

    return fmean(values), stdev(values) if len(values) > 1 else None


@dataclass
class Cell:
    ours: tuple[float, float | None] | None  # mean, std over the runs that measured it
    paper: tuple[float, float | None] | None
    measured: bool  # whether clbench measures the column at all

    @property
    def diff(self) -> float | None:
        return None if self.ours is None or self.paper is None else self.ours[0] - self.paper[0]


@dataclass
class Line:
    row: PaperRow
    runs: list[Run]
    cells: list[Cell]
    overrides: list[str] = field(default_factory=list)  # of the row's preset, that its runs were made with

    @property
    def reconstructed(self) -> bool:
        return any(r.get("reconstructed") for r in self.runs)


def lines(table: PaperTable, rows: dict[str, list[Run]], overrides: dict[str, list[str]]) -> list[Line]:
    out = []
    for row in table.rows:
        runs = rows.get(row.preset, []) if row.preset else []
        cells = []
        for column in table.columns:
            values = [v for v in (read(r, column.reads) for r in runs) if v is not None]
            ours = mean_std(values) if values else None
            cells.append(Cell(ours, row.published.get(column.key), column.reads is not None))
        out.append(Line(row, runs, cells, overrides.get(row.preset, []) if row.preset else []))
    return out


# ----------------------------------------------------------------------------------------------------- the outputs
def number(pair: tuple[float, float | None] | None, pm: str, absent: str) -> str:
    if pair is None:
        return absent
    mean, std = pair
    return f"{mean:.2f}" if std is None else f"{mean:.2f} {pm} {std:.2f}"


def texts(line: Line, pm: str, dash: str) -> list[str]:
    """Per column: clbench, paper, difference; empty where the row was not run, n/m where clbench does not measure."""
    out = []
    for cell in line.cells:
        if not line.runs:
            ours = ""
        elif not cell.measured:
            ours = "n/m"
        else:
            ours = number(cell.ours, pm, dash)
        diff = "" if cell.diff is None else f"{cell.diff:+.2f}"
        out += [ours, number(cell.paper, pm, dash), diff]
    return out


RECONSTRUCTED = "† reconstructed method (results.json `reconstructed: true`): not the paper's method."


OVERRIDDEN = "* made with overrides of the row's preset (weights: the same file, by its SHA-256, for every run):"


def label(line: Line, mark: str = "†") -> str:
    """The paper's label, with † for a reconstructed method and * where the runs overrode the row's preset."""
    return line.row.label + (f" {mark}" if line.reconstructed else "") + (" *" if line.overrides else "")


def notes(table_lines: list[Line]) -> list[str]:
    """The legends under the table: † where a row is reconstructed, and each row made with overrides of its preset."""
    made = [
        f"{line.row.label}{f' ({line.row.buffer})' if line.row.buffer else ''}: {', '.join(line.overrides)}"
        for line in table_lines
        if line.overrides
    ]
    reconstructed = [RECONSTRUCTED] if any(line.reconstructed for line in table_lines) else []
    return reconstructed + ([f"{OVERRIDDEN} {'; '.join(made)}."] if made else [])


def headers(table: PaperTable) -> list[str]:
    return [f"{c.label} {part}" for c in table.columns for part in ("clbench", "paper", "Δ")]


def has_buffer(table: PaperTable) -> bool:
    return any(r.buffer is not None for r in table.rows)


def markdown(table: PaperTable, table_lines: list[Line], apart: list[Apart], others: list[Any]) -> str:
    buffer = ["Buffer"] if has_buffer(table) else []
    head = ["Method", *buffer, "Preset", "runs", *headers(table)]
    out = [
        f"## {table.title}",
        "",
        f"Published: {table.citation}",
        "",
        f"clbench: mean ± std over the row's runs (seeds); Δ = clbench − paper; empty: not run; n/m: not measured by "
        f"clbench; –: none. The whole table: `{table.multirun}`.",
        *[f"\n{note}" for note in table.notes],
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for line in table_lines:
        buf = [line.row.buffer or ""] if buffer else []
        cells = [label(line), *buf, line.row.preset or "(no preset)", str(len(line.runs)) if line.runs else ""]
        cells += texts(line, "±", "–")
        out.append("| " + " | ".join(c.replace("|", r"\|") for c in cells) + " |")
    out += [text for note in notes(table_lines) for text in ("", note)]
    if apart:
        out += ["", f"Not rows of this table (not averaged): {len(apart)}", *[f"- {a}" for a in apart]]
    if others:
        out += ["", "Not averaged (did not finish, not reportable or duplicates):", *[f"- {o}" for o in others]]
    return "\n".join(out) + "\n"


def csv_text(table: PaperTable, table_lines: list[Line]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    parts = ("mean", "std", "paper", "paper_std", "diff")
    writer.writerow(
        ["label", "buffer", "preset", "runs", "reconstructed", *[f"{c.key}_{p}" for c in table.columns for p in parts]]
    )
    for line in table_lines:
        values = []
        for cell in line.cells:
            ours, paper = cell.ours or (None, None), cell.paper or (None, None)
            values += ["" if v is None else f"{v:.4f}" for v in (*ours, *paper, cell.diff)]
        writer.writerow(
            [line.row.label, line.row.buffer or "", line.row.preset or "", len(line.runs), line.reconstructed, *values]
        )
    return buf.getvalue()


def tex_escape(text: str) -> str:
    """Escape the characters LaTeX reads as commands in a table cell; –, Δ and † in LaTeX's spelling."""
    for char in "_%&#":
        text = text.replace(char, f"\\{char}")
    return text.replace("–", "--").replace("Δ", r"$\Delta$").replace("†", r"$^\dagger$")


def latex(table: PaperTable, table_lines: list[Line]) -> str:
    buffer = ["Buffer"] if has_buffer(table) else []
    head = " & ".join(map(tex_escape, ["Method", *buffer, "$n$", *headers(table)])) + r" \\"
    body = []
    for line in table_lines:
        buf = [line.row.buffer or ""] if buffer else []
        cells = [label(line), *buf, str(len(line.runs)) if line.runs else "", *texts(line, r"$\pm$", "--")]
        body.append(" & ".join(tex_escape(c) if "$" not in c else c for c in cells) + r" \\")
    spec = "l" * (1 + len(buffer)) + "r" * (1 + 3 * len(table.columns))
    return (
        "\n".join(
            [
                f"% {table.title}. Published: {table.citation}",
                *booktabs(spec, head, body, notes(table_lines)),
            ]
        )
        + "\n"
    )


def booktabs(spec: str, head: str, body: list[str], notes: list[str]) -> list[str]:
    """A booktabs tabular of column ``spec``: ``head``, the ``body`` rows and the ``notes`` (the † legend, ...) as
    rows spanning every column below the rule."""
    return [
        rf"\begin{{tabular}}{{{spec}}}",
        r"\toprule",
        head,
        r"\midrule",
        *body,
        r"\bottomrule",
        *[rf"\multicolumn{{{len(spec)}}}{{l}}{{\footnotesize {tex_escape(n.replace('`', ''))}}} \\" for n in notes],
        r"\end{tabular}",
    ]


def report(name: str, runs: list[Run], others: list[Any]) -> dict[str, str]:
    """The table ``name`` over ``runs`` as {suffix: text} (.md, .csv, .tex); ``others``: runs not averaged anyway."""
    table = load_table(name)
    rows, apart, overrides = place(table, runs)
    table_lines = lines(table, rows, overrides)
    return {
        ".md": markdown(table, table_lines, apart, others),
        ".csv": csv_text(table, table_lines),
        ".tex": latex(table, table_lines),
    }
