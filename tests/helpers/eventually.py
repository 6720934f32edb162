"""The one way the tests wait: poll a condition until it holds.

A test never measures how long something took (a busy 2-core machine makes every duration
a flake); it checks *what* happened, and waits for it with a deadline generous enough that
only something that never happens reaches it. The deadline passing is a failure that names
what never happened and the condition's last value.

An exception the condition raises propagates at once: a condition can fail fast (a process
that exited, a stream that ended with the wrong error) instead of waiting out the deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 120.0  # generous: nothing a test waits for takes a minute, even on 2 busy cores
INTERVAL_S = 0.01


def _failure(condition, what: str | None, timeout: float, value) -> AssertionError:
    name = what or getattr(condition, "__qualname__", repr(condition))
    return AssertionError(f"{name}: not within {timeout:g} s (last value: {value!r})")


def eventually(
    condition: Callable[[], T],
    what: str | None = None,
    *,
    timeout: float = DEADLINE_S,
    interval: float = INTERVAL_S,
) -> T:
    """Call condition() until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(condition, what, timeout, value)
        time.sleep(interval)


async def eventually_async(
    condition: Callable[[], T | Awaitable[T]],
    what: str | None = None,
    *,
    timeout: float = DEADLINE_S,
    interval: float = INTERVAL_S,
) -> T:
    """eventually() on the running event loop: condition is a plain callable or returns an
    awaitable (a coroutine function); the loop runs between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(condition, what, timeout, value)
        await asyncio.sleep(interval)
