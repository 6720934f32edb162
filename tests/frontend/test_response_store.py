"""ResponseStore: bounded by entry count, age and bytes, least recently used evicted first;
its bounds are FrontendConfig flags that reach `pagestream serve` and the frontend child."""

from __future__ import annotations

import pytest

from pagestream.cli import build_parser
from pagestream.split_layout import frontend_flags
from services.common.flags import from_flags
from services.frontend.frontend_config import FrontendConfig
from services.frontend.openai.chat_messages import ChatMessage
from services.frontend.openai.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _conversation(text: str = "hi") -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text), ChatMessage(role="assistant", content="ok")]


def _put(store: ResponseStore, response_id: str, text: str = "hi") -> bool:
    return store.put(response_id, {"id": response_id, "output": []}, _conversation(text))


def test_get_returns_what_was_put():
    store = ResponseStore()
    assert _put(store, "resp_1")
    entry = store.get("resp_1")
    assert entry.response == {"id": "resp_1", "output": []}
    assert [m.content for m in entry.conversation] == ["hi", "ok"]
    assert store.get("resp_2") is None and "resp_1" in store and len(store) == 1


def test_the_entry_count_is_a_bound_least_recently_used_first():
    store = ResponseStore(max_entries=3)
    for i in range(3):
        _put(store, f"r{i}")
    store.get("r0")  # r0 is now the most recently used: r1 goes first
    _put(store, "r3")
    assert [r in store for r in ("r0", "r1", "r2", "r3")] == [True, False, True, True]
    for i in range(4, 60):
        _put(store, f"r{i}")
        assert len(store) <= 3
    assert all(f"r{i}" not in store for i in range(57)) and len(store) == 3


def test_entries_expire_by_age_read_or_not():
    clock = Clock()
    store = ResponseStore(max_age_s=10.0, clock=clock)
    _put(store, "old")
    clock.now += 6
    _put(store, "new")
    assert store.get("old") is not None  # a read does not make it younger
    clock.now += 5
    assert store.get("old") is None and store.get("new") is not None
    clock.now += 5
    assert store.get("new") is None and len(store) == 0 and store.num_bytes == 0


def test_bytes_are_a_bound():
    store = ResponseStore(max_bytes=2000)
    _put(store, "a")
    one = store.num_bytes
    assert 0 < one < 2000
    for i in range(100):
        _put(store, f"r{i}")
        assert store.num_bytes <= 2000
    assert len(store) == 2000 // one and "a" not in store
    assert not _put(store, "huge", "x" * 5000)  # over the bound alone: not kept at all
    assert "huge" not in store and store.num_bytes <= 2000


def test_put_replaces_and_delete_forgets():
    store = ResponseStore(max_entries=2)
    _put(store, "a", "first")
    _put(store, "a", "second")
    assert len(store) == 1 and store.get("a").conversation[0].content == "second"
    assert store.delete("a") and not store.delete("a") and store.num_bytes == 0


def test_zero_entries_stores_nothing():
    store = ResponseStore(max_entries=0)
    assert not store.enabled and not _put(store, "a") and store.get("a") is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_entries": -1}, "max_entries"),
        ({"max_age_s": 0}, "max_age_s"),
        ({"max_bytes": -1}, "max_bytes"),
    ],
)
def test_bad_bounds_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ResponseStore(**kwargs)


def test_the_flags_reach_serve_and_the_frontend_child():
    argv = ["serve", "m", "--responses-store-max-entries", "5", "--responses-store-max-age", "9"]
    ns = build_parser().parse_args([*argv, "--responses-store-max-bytes", "4096"])
    store = ResponseStore.from_config(from_flags(FrontendConfig, ns))
    assert (store.max_entries, store.max_age_s, store.max_bytes) == (5, 9.0, 4096)
    flags = frontend_flags(ns, [1234])
    child = build_parser().parse_args(["frontend", "m", *flags])
    assert from_flags(FrontendConfig, child) == from_flags(FrontendConfig, ns)
    with pytest.raises(ValueError, match="responses_store_max_age_s"):
        FrontendConfig(responses_store_max_age_s=0)
    with pytest.raises(ValueError, match="responses_store_max_entries"):
        FrontendConfig(responses_store_max_entries=-1)
