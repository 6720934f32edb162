"""One answer to where the cache is, for the model converter and the kernel build alike."""

from pathlib import Path

from services.common.cache_dir import CACHE_ENV, cache_dir


def test_the_cache_is_pagestream_cache_else_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(CACHE_ENV, "~/shared")
    assert cache_dir() == tmp_path / "home" / "shared"
    default = tmp_path / "home" / ".cache" / "pagestream"
    monkeypatch.setenv(CACHE_ENV, "")  # empty counts as unset, not as the working folder
    assert cache_dir() == default
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() == default
    assert isinstance(cache_dir(), Path)
