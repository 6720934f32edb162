"""ResponseStore: the Responses API's stored responses, bounded in memory.

Each stored response keeps its body (what GET /v1/responses/{id} returns) and its
conversation as chat messages (without its instructions), which a request naming it as
`previous_response_id` continues. vLLM keeps these forever; here the number of entries,
their age and their size are bounded at every moment (ResponseStore).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.frontend.openai.chat_messages import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response body, as JSON
    conversation: tuple[ChatMessage, ...]  # input items and output, without instructions
    num_bytes: int
    stored_at: float
    input_items: tuple[dict, ...] = ()  # this response's own input, as OpenAI's items


class ResponseStore:
    """Three bounds hold at every moment: the number of entries, their age (a response older
    than max_age_s is gone, whether or not it was read since), and their size in bytes
    (their JSON, estimated once when stored). Over a bound, the least recently used entry
    goes first; one entry larger than max_bytes is not kept at all.

    One event loop uses it (no locks): every method is synchronous, so a request that reads
    an entry and later stores its own never interleaves with another inside either call.
    """

    def __init__(
        self,
        max_entries: int = 1000,
        max_age_s: float = 3600.0,
        max_bytes: int = 64 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 (0: store none), got {max_entries}.")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}.")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no limit), got {max_bytes}.")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._by_use: OrderedDict[str, StoredResponse] = OrderedDict()  # least recent first
        self._by_age: OrderedDict[str, float] = OrderedDict()  # oldest first
        self._num_bytes = 0

    @classmethod
    def from_config(cls, config) -> ResponseStore:
        """The store a FrontendConfig's --responses-store-* flags describe."""
        return cls(
            config.responses_store_max_entries,
            config.responses_store_max_age_s,
            config.responses_store_max_bytes,
        )

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        self._expire()
        return len(self._by_use)

    def __contains__(self, response_id: str) -> bool:
        self._expire()
        return response_id in self._by_use

    def put(
        self,
        response_id: str,
        response: dict,
        conversation: list[ChatMessage],
        input_items: list[dict] = (),
    ) -> bool:
        """Keep a response (replacing one of that id); False when it is not kept (storing
        is off, or it alone is over max_bytes)."""
        if not self.enabled:
            return False
        self.delete(response_id)
        num_bytes = _size(response, conversation, input_items)
        if self.max_bytes and num_bytes > self.max_bytes:
            return False
        now = self._clock()
        entry = StoredResponse(response, tuple(conversation), num_bytes, now, tuple(input_items))
        self._by_use[response_id] = entry
        self._by_age[response_id] = now
        self._num_bytes += num_bytes
        self._expire()
        self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None: never stored,
        evicted, expired or deleted."""
        self._expire()
        entry = self._by_use.get(response_id)
        if entry is not None:
            self._by_use.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._by_use.pop(response_id, None)
        if entry is None:
            return False
        del self._by_age[response_id]
        self._num_bytes -= entry.num_bytes
        return True

    def _expire(self) -> None:
        deadline = self._clock() - self.max_age_s
        while self._by_age:
            response_id, stored_at = next(iter(self._by_age.items()))
            if stored_at > deadline:
                return
            self.delete(response_id)

    def _evict(self) -> None:
        while len(self._by_use) > self.max_entries or (
            self.max_bytes and self._num_bytes > self.max_bytes
        ):
            self.delete(next(iter(self._by_use)))


def _size(response: dict, conversation: list[ChatMessage], input_items=()) -> int:
    """Bytes of the entry's JSON (what it costs in memory, to within a small factor)."""
    messages = sum(len(m.model_dump_json(exclude_none=True)) for m in conversation)
    items = sum(len(json.dumps(item, separators=(",", ":"))) for item in input_items)
    return len(json.dumps(response, separators=(",", ":"))) + messages + items
