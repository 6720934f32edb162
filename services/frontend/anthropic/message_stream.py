"""The Messages API's SSE stream for a running request.

Anthropic's event sequence: message_start (the message without content, with the input
usage), a ping, then per content block content_block_start / content_block_delta... /
content_block_stop, then message_delta (stop reason, final usage) and message_stop. Each
event is `event: TYPE` and `data: JSON`. message_start goes out with the first engine
output, before any text is known (its first token may be held back by a parser), so a
client sees the stream begin as soon as an OpenAI chat stream's first chunk would. A
failure after that ends the stream with an `error` event in Anthropic's error shape.
"""

from __future__ import annotations

import contextlib
import json
import logging

from services.frontend.anthropic.errors import to_anthropic_error
from services.frontend.anthropic.message_tracker import MessageTracker

logger = logging.getLogger(__name__)

__all__ = ["message_events", "sse_event"]

PING = {"type": "ping"}


def sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def message_events(tracker: MessageTracker, first, outputs):
    """The stream of a request whose first output is `first`; `outputs` the rest."""
    async with contextlib.aclosing(outputs):
        try:
            events = tracker.update(*first)  # its cached-token count goes in message_start
            yield sse_event(tracker.start_event())
            yield sse_event(PING)
            for event in events:
                yield sse_event(event)
            async for index, output in outputs:
                for event in tracker.update(index, output):
                    yield sse_event(event)
            for event in tracker.end_events():
                yield sse_event(event)
        except Exception as exc:
            logger.warning("messages stream failed: %s", exc)
            yield to_anthropic_error(exc).sse()
