"""SectionReport: one section of docs/benchmarks.md from its results alone: its heading, how to
reproduce it, the method in words, then every figure: each group's scalars as a bullet, each
list or mapping of like records as a table (a wide one of few rows turned on its side)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

WIDE = 14  # columns beyond which a table of few rows is turned on its side
TALL = 5  # the most rows of a table that is turned
HIDDEN = frozenset({"meta", "token_ids", "series", "failure_examples"})  # no figures
WORDS = (  # a result key's words, in this order
    (r"_per_s\b", "/s"),
    (r"(^|_)tok_s(_|$)", r"\1tok/s\2"),
    (r"^vs_", "x vs "),
    (r"_vs_", " x vs "),
    (r"_", " "),
)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("—" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def measured(part: dict, default_command: str) -> str:
    """ "Reproduce: `command` (profile, model); measured DATE on CPU (cores, torch), load ..."."""
    meta = part.get("meta", {})
    machine = meta.get("machine", {})
    text = (
        f"Reproduce: `{meta.get('command', default_command)}` (profile `{meta.get('profile')}`, "
        f"model `{meta.get('model')}`); measured {machine.get('date')} on {machine.get('cpu')} "
        f"({machine.get('cores')} cores, torch {machine.get('torch')})"
    )
    if load := part.get("load_average"):
        text += f", load average {load['start']} at the start and {load['end']} at the end"
    return text + "."


def words(key: str) -> str:
    """A result key as a header: output_tok_s_per_round -> "output tok/s per round"."""
    for pattern, replacement in WORDS:
        key = re.sub(pattern, replacement, key)
    return key


@dataclass(frozen=True)
class SectionReport:
    heading: str  # "## HEADING"
    command: str  # the default `pagestream bench ...` of the reproduce sentence
    method: str = ""  # how it was measured, in words (the figures come from the results)
    code: tuple[str, ...] = ()  # keys shown as JSON (a schema)
    group_by: dict[str, str] = field(default_factory=dict)  # rows key -> a table per value
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a mapping's key columns
    plots: tuple[str, ...] = ()  # <docs>/benchmarks/PLOT.png (benchmarks/plots.py)
    notes: Path | None = None  # hand-written words rendered after the figures

    def render(self, part: dict) -> list[str]:
        out = [f"## {self.heading}", "", self.method]
        out += self._figures(part, ())
        out += [line for plot in self.plots for line in ("", f"![{plot}](benchmarks/{plot}.png)")]
        if self.notes and self.notes.exists():
            out += ["", self.notes.read_text(encoding="utf-8").strip()]
        return out

    def _figures(self, part: dict, path: tuple[str, ...]) -> list[str]:
        lead = ["", measured(part, self.command)] if "meta" in part else []  # a run's part
        facts, out = [], []
        for key, value in part.items():
            if key in HIDDEN or (key == "load_average" and lead):  # that in the sentence
                continue
            where = (*path, key)
            if key in self.code:
                out += ["", f"{words(key)}:", "", "```json", json.dumps(value), "```"]
            elif _is_rows(value) and isinstance(value, list) and any(map(_has_rows, value)):
                for item in value:  # records holding rows of their own: a part each
                    name = next(iter(item.values()))
                    out += ["", f"### {words(key)}: {name}", *self._figures(item, where)]
            elif _is_rows(value):
                names = (*self.keys.get(key, ()), words(key), "")
                out += self._table(where, _rows(value, names))
            elif isinstance(value, dict) and value:
                heading = ["", f"### {words(key)}"] if "meta" in value else []
                out += heading + self._figures(value, where)
            else:
                facts.append(f"{words(key)} {_cell(value)}")
        if facts:
            title = " · ".join(map(words, path)) or "figures"
            out = ["", f"- {title}: " + "; ".join(facts), *out]
        return lead + out

    def _table(self, path: tuple[str, ...], rows: list[dict]) -> list[str]:
        by = self.group_by.get(path[-1])
        groups = {}
        for row in rows:  # a table per value of `by`, the value in its title
            rest = {k: v for k, v in row.items() if k != by}
            groups.setdefault(row.get(by) if by else None, []).append(rest)
        out = []
        for name, group in groups.items():
            title = " · ".join(map(words, path)) + (f": {by} {name}" if name is not None else "")
            out += ["", f"### {title}" if len(path) == 1 else f"{title}:", "", _grid(group)]
        return out


def _is_rows(value) -> bool:
    """A list of records, or a mapping of two or more records (or of groups of like records)."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, dict) for v in value)
    if not isinstance(value, dict) or len(value) < 2:
        return False
    if not all(isinstance(v, dict) for v in value.values()):
        return False
    groups = [v for v in value.values() if v and all(isinstance(r, dict) for r in v.values())]
    shapes = {frozenset(next(iter(g.values()))) for g in groups}
    return not groups or (len(groups) == len(value) and len(shapes) == 1)


def _has_rows(record: dict) -> bool:
    return any(isinstance(v, list) and _is_rows(v) for v in record.values())


def _rows(value, names: tuple[str, ...]) -> list[dict]:
    """Flat rows of a list of records, or of a mapping (its keys the first columns)."""
    if isinstance(value, list):
        return [_flat(v) for v in value]
    rows = []
    for name, record in value.items():
        if record and all(isinstance(v, dict) for v in record.values()):
            rows += [{names[0]: name, **row} for row in _rows(record, names[1:])]
        else:
            rows.append({names[0]: name, **_flat(record)})
    return rows


def _flat(record: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in record.items():
        if key in HIDDEN:
            continue
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _grid(rows: list[dict]) -> str:
    header = list(dict.fromkeys(k for row in rows for k in row))
    if len(header) > WIDE and len(rows) <= TALL:  # on its side: a row per field
        first = header[0]
        return table(
            [first, *(_cell(r.get(first)) for r in rows)],
            [[words(k), *(_cell(r.get(k)) for r in rows)] for k in header[1:]],
        )
    return table(list(map(words, header)), [[_cell(r.get(k)) for k in header] for r in rows])


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        if value and all(isinstance(v, list) for v in value):
            return "; ".join(" / ".join(map(_cell, v)) for v in value)
        return ", ".join(map(_cell, value)) or "—"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items()) or "—"
    return " ".join(str(value).split()).replace("|", "\\|")
