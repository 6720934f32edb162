"""Command-line flags derived from config dataclasses: each argument is declared once.

A config field declared with `flag(default, help, ...)` carries its CLI form in its
metadata; from it come the parser (`add_flags`; a flag's parsed value is stored under
its field's name), the config from parsed flags
(`from_flags`), the argv that hands a config to a child process (`to_flags`: the values
that differ from what the child's parser would default to) and the flag reference in the
docs (`flag_table`). A field's type annotation gives the flag's type; a bool becomes
`--name / --no-name`, a `tuple[str, ...]` takes one or more values (`--name A B`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# A flag whose CLI default is the field's own default.
FIELD_DEFAULT = type("FieldDefault", (), {"__repr__": lambda self: "FIELD_DEFAULT"})()


@dataclass(frozen=True)
class FlagSpec:
    help: str
    name: str | None = None  # the flag without "--" (default: the field name, dashed)
    short: str | None = None  # e.g. "-tp"
    choices: tuple | None = None
    cli_default: object = FIELD_DEFAULT  # where the CLI's default differs from the field's

    def flag_name(self, field_name: str) -> str:
        return "--" + (self.name or field_name.replace("_", "-"))


def flag(
    default,
    help: str,
    *,
    name: str | None = None,
    short: str | None = None,
    choices: Iterable | None = None,
    cli_default: object = FIELD_DEFAULT,
):
    """A dataclass field that is also a command-line flag."""
    spec = FlagSpec(help, name, short, None if choices is None else tuple(choices), cli_default)
    return dataclasses.field(default=default, metadata={"flag": spec})


def flag_fields(cls, only: Iterable[str] | None = None) -> list[tuple[dataclasses.Field, FlagSpec]]:
    """The fields of `cls` that are flags (in declaration order), or just those named."""
    wanted = None if only is None else set(only)
    found = [
        (f, f.metadata["flag"])
        for f in dataclasses.fields(cls)
        if "flag" in f.metadata and (wanted is None or f.name in wanted)
    ]
    if wanted is not None and len(found) != len(wanted):
        missing = wanted - {f.name for f, _ in found}
        raise ValueError(f"{cls.__name__} has no flags {sorted(missing)}")
    return found


def cli_default(field: dataclasses.Field, spec: FlagSpec):
    return field.default if spec.cli_default is FIELD_DEFAULT else spec.cli_default


def _value_type(cls, field: dataclasses.Field):
    """int / float / str / bool from the annotation (`X | None` is X; a union of several
    types, such as a size given as bytes or "4GiB", is read as str)."""
    hint = typing.get_type_hints(cls)[field.name]
    if typing.get_origin(hint) is tuple:
        return tuple
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else str
    return hint


def add_flags(parser: argparse.ArgumentParser, cls, only: Iterable[str] | None = None) -> None:
    for field, spec in flag_fields(cls, only):
        names = [spec.flag_name(field.name), *([spec.short] if spec.short else [])]
        kind = _value_type(cls, field)
        options = {"dest": field.name, "default": cli_default(field, spec)}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif kind is tuple:
            options.update(nargs="+", type=str, metavar=names[0][2:].upper().replace("-", "_"))
        else:
            options["type"] = kind
            if spec.choices is not None:
                options["choices"] = spec.choices
            else:
                options["metavar"] = names[0][2:].upper().replace("-", "_")
        parser.add_argument(*names, help=spec.help, **options)


def from_flags(cls, ns: argparse.Namespace, **values):
    """`cls` from parsed flags (those the parser lacks keep the field's default)."""
    for field, _ in flag_fields(cls):
        if field.name not in values and hasattr(ns, field.name):
            value = getattr(ns, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def to_flags(config, only: Iterable[str] | None = None) -> list[str]:
    """The argv that gives a child's parser this config (or just the flags named): every
    flag whose value differs from the CLI's default (None: the default's own meaning)."""
    argv: list[str] = []
    for field, spec in flag_fields(type(config), only):
        value = getattr(config, field.name)
        if value is None or value == cli_default(field, spec):
            continue
        name = spec.flag_name(field.name)
        if isinstance(value, Mapping):
            value = json.dumps(dict(value))  # a JSON flag given as a dict (the Python API's)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, tuple | list):
            argv += [name, *map(str, value)]
        elif str(value).startswith("-"):
            argv.append(f"{name}={value}")  # a separate "-x" would read as a flag
        else:
            argv += [name, str(value)]
    return argv


def flag_table(cls) -> list[tuple[str, str, str]]:
    """(flag, default, help) rows for a reference table (the help ends with the choices)."""
    rows = []
    for field, spec in flag_fields(cls):
        names = ", ".join(n for n in (spec.flag_name(field.name), spec.short) if n)
        default = cli_default(field, spec)
        text = spec.help
        if spec.choices is not None:
            text += " (one of: " + ", ".join(map(str, spec.choices)) + ")"
        rows.append((names, "" if default is None else str(default), text))
    return rows
