"""The report's markdown pieces: a table, and the sentence that says how to reproduce a part."""

from __future__ import annotations


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
    load = part.get("load_average")
    if load:
        text += f", load average {load['start']} at the start and {load['end']} at the end"
    return text + "."
