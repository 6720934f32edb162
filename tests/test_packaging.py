"""The distribution's top-level packages are its own: no other installed distribution ships a
package of the same name (ours would shadow it, or it ours: transformers imports HF's
`kernels` package, which a top-level `kernels` of ours once hid, breaking every import of a
transformers model class). constraints.txt pins every distribution `make test` installs, at
the version installed, inside pyproject.toml's ranges."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

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


# ---- the pins --------------------------------------------------------------------------
CONSTRAINTS = ROOT / "constraints.txt"
INSTALLED_EXTRAS = {"dev", "ray"}  # what `make test` installs: .[dev], which takes [ray]


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, Version]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: a pin is exact"
            assert _name(requirement.name) not in pins, f"{line}: pinned twice"
            pins[_name(requirement.name)] = Version(spec.version)
    return pins


def _requirements(dist: str, extras: set[str]) -> list[Requirement]:
    """The requirements of an installed distribution that apply here with these extras."""
    applies = []
    for text in importlib.metadata.requires(dist) or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": e}) for e in extras or {""}):
            applies.append(requirement)
    return applies


def _installed_closure() -> dict[str, Requirement | None]:
    """Every distribution `make test` installs: pagestream with its extras, transitively."""
    seen: dict[str, Requirement | None] = {}
    todo = [("pagestream", INSTALLED_EXTRAS)]
    while todo:
        dist, extras = todo.pop()
        for requirement in _requirements(dist, extras):
            name = _name(requirement.name)
            if name == "pagestream":  # .[dev] names pagestream[ray]
                continue
            if name not in seen:
                todo.append((name, set(requirement.extras)))
            seen.setdefault(name, requirement)
    return seen


def test_the_pins_are_exact_and_carry_no_local_label():
    pins = _pins()
    assert pins["torch"] == Version("2.13.0")  # the CPU wheel, 2.13.0+cpu, satisfies it
    assert [name for name, version in pins.items() if version.local] == []


def test_every_installed_distribution_is_pinned_and_installed_at_its_pin():
    pins = _pins()
    closure = _installed_closure()
    assert {"torch", "transformers", "grpcio", "pytest"} <= closure.keys()
    assert sorted(closure.keys() - pins.keys()) == [], "installed but not pinned"
    for name in closure:
        installed = Version(importlib.metadata.version(name))
        assert installed.public == str(pins[name]), f"{name} {installed}, pinned {pins[name]}"


def test_the_pins_lie_in_pyprojects_ranges():
    """pyproject.toml keeps the compatibility ranges; the pins are one point inside them."""
    pins = _pins()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*pyproject["dependencies"]]
    for extra in INSTALLED_EXTRAS:
        declared += pyproject["optional-dependencies"][extra]
    for text in declared:
        requirement = Requirement(text)
        if _name(requirement.name) == "pagestream":
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        pin = pins[_name(requirement.name)]
        assert requirement.specifier.contains(pin, prereleases=True), f"{text}: pinned {pin}"
