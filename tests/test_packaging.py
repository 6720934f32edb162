"""The distribution's top-level packages are its own: no other installed distribution ships a
package of the same name (ours would shadow it, or it ours: transformers imports HF's
`kernels` package, which a top-level `kernels` of ours once hid, breaking every import of a
transformers model class)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _our_top_level_packages() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in patterns]


def test_no_other_distribution_ships_our_top_level_packages():
    owners = importlib.metadata.packages_distributions()
    packages = _our_top_level_packages()
    assert packages, "pyproject.toml lists no packages"
    for package in packages:
        assert (ROOT / package / "__init__.py").is_file(), package
        others = {owner for owner in owners.get(package, []) if owner != "pagestream"}
        assert not others, f"top-level package {package!r} is also shipped by {sorted(others)}"


def test_transformers_imports_with_our_packages_on_the_path():
    from transformers import AutoConfig, LlamaForCausalLM  # hub_kernels imports `kernels`

    assert AutoConfig.__module__.startswith("transformers.")
    assert LlamaForCausalLM.__module__.startswith("transformers.models.llama")
