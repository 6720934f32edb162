"""Self-contained report sections (routing, structured outputs): a markdown table, and
putting a section into benchmarks.md in place of an earlier one, before the CPU notes."""

from __future__ import annotations

from pathlib import Path


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("—" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def replace_section(path: Path, heading: str, section: str) -> None:
    """Write `section` (starting with `heading`) into the report, replacing the old one."""
    text = _without_section(path.read_text(encoding="utf-8"), heading)
    path.write_text(_splice(text, section), encoding="utf-8")


def _without_section(text: str, heading: str) -> str:
    start = text.find(heading + "\n")
    if start < 0:
        return text
    end = text.find("\n## ", start + len(heading))
    return text[:start] + ("" if end < 0 else text[end + 1 :])


def _splice(text: str, section: str) -> str:
    """The section before the CPU notes (the report's last part) when they are there."""
    from benchmarks.report import CPU_NOTES

    notes = CPU_NOTES.read_text(encoding="utf-8").strip() if CPU_NOTES.exists() else ""
    at = text.find(notes.splitlines()[0]) if notes else -1
    if at < 0:
        return text.rstrip("\n") + "\n\n" + section + "\n"
    return text[:at] + section.rstrip("\n") + "\n\n" + text[at:]
