"""What the benchmark tests share: `pagestream bench` run on a tiny model into a docs folder,
and the report it writes, its tables checked well formed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.cli import add_bench_parser, run_bench


def bench_args(docs: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv, "--docs-dir", str(docs)])


def bench(docs: Path, *argv: str, times: int = 1) -> dict:
    """`pagestream bench ARGV --docs-dir DOCS`, `times` times; what results.json holds."""
    args = bench_args(docs, *argv)
    for _ in range(times):
        assert run_bench(args) == 0
    return json.loads((docs / "benchmarks" / "results.json").read_text())


def report(docs: Path) -> str:
    """docs/benchmarks.md, every table row of it well formed (no None, closed)."""
    text = (docs / "benchmarks.md").read_text()
    assert_tables(text)
    return text


def assert_tables(text: str) -> None:
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            assert line.endswith("|") and "None" not in line, line
