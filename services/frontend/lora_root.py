"""LoRARoot: the one directory clients may load LoRA adapters from at run time
(--lora-root).

A client's path (absolute, or relative to the root) is resolved as the file system will
open it (os.path.realpath: every symlink followed, `..` collapsed) and must lie inside the
root, and so must each adapter file in it: a symlink inside the root that points out is
refused like a path outside. The reason a path is refused names the file system, so it
is for the server log only (serving_lora.py answers every refusal with one text).
"""

from __future__ import annotations

import os

from services.common.lora_adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError

# Linux's PATH_MAX: no longer path opens, so none is worth resolving.
MAX_PATH_CHARS = 4096


class LoRARoot:
    def __init__(self, root: str) -> None:
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise ValueError(f"--lora-root {root!r}: not a directory.")
        self.path = real  # resolved once: later paths are compared with it as it is now

    def resolve(self, path: str) -> str:
        """The adapter folder `path` names, resolved; LoRAAdapterError (for the log) when it
        or one of its adapter files resolves outside the root, or it is not a folder."""
        if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
            raise LoRAAdapterError(f"{path[:100]!r}: not a path of at most {MAX_PATH_CHARS} chars.")
        folder = self._inside(os.path.join(self.path, path), path)
        if not os.path.isdir(folder):
            raise LoRAAdapterError(f"{path!r} resolves to {folder}, which is not a directory.")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            self._inside(os.path.join(folder, name), path)
        return folder

    def _inside(self, path: str, asked: str) -> str:
        real = os.path.realpath(path)
        if os.path.commonpath([self.path, real]) != self.path:
            raise LoRAAdapterError(
                f"{asked!r}: {path} resolves to {real}, outside --lora-root {self.path}."
            )
        return real
