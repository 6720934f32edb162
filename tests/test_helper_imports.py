"""Shared test code lives in tests/helpers/: no test module imports from another test module
or from a conftest (fixtures reach tests through pytest, helpers through imports)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _is_test_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return module.startswith("tests.") and (last == "conftest" or last.startswith("test_"))


def _imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
    return modules


def test_no_test_module_or_conftest_is_imported():
    offenders = [
        f"{path.relative_to(TESTS.parent)}: {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in _imported_modules(path)
        if _is_test_module(module)
    ]
    assert not offenders, "move shared code to tests/helpers/:\n" + "\n".join(offenders)
