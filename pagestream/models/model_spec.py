"""ModelSpec: one model a multi-model serve may load, by its name."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from pagestream.engine_args import EngineArgs

# What clients send as `model` and what /v1/models lists: bounded, no path separators.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}")


def check_model_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"model name {name!r}: 1-128 characters of letters, digits and . _ : + -, "
            "starting with a letter or digit."
        )
    return name


@dataclass(frozen=True)
class ModelSpec:
    """`args`: its engine arguments (served_model_name = name), validated at start.
    `mmproj`: llama.cpp's projector beside a GGUF, converted with it at the first load
    (EngineArgs converts the pair as it is built, so the start does not pay for it)."""

    name: str
    args: EngineArgs
    pinned: bool = False
    mmproj: str | None = None

    def engine_args(self) -> EngineArgs:
        """The arguments the load uses (the pair converted here, once, into the cache)."""
        return self.args if self.mmproj is None else replace(self.args, mmproj=self.mmproj)
