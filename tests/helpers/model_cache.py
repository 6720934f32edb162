"""An isolated $PAGESTREAM_CACHE for tests that convert models."""

from __future__ import annotations

from pathlib import Path

import pytest


def isolated_model_cache(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$PAGESTREAM_CACHE at `root` for the models a test converts, sharing the real cache's
    built C++ kernels (a fresh one would compile them again in every worker process)."""
    from services.common.cache_dir import cache_dir

    kernels = cache_dir() / "torch_extensions"
    kernels.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "torch_extensions").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("PAGESTREAM_CACHE", str(root))
    return root
