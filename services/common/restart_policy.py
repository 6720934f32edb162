"""RestartPolicy: restart a child that dies, with backoff, until it dies too often.

A child may be restarted at most `max_restarts` times within any `window_s` seconds; the
death after that is given up on. The policy holds no state: its owner keeps the monotonic
times of one child's recent restarts and passes them in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.common.backoff import Backoff


@dataclass(frozen=True)
class RestartPolicy:
    backoff: Backoff
    max_restarts: int
    window_s: float

    def next_delay(self, recent: deque[float], now: float) -> float | None:
        """After a death at `now`: the wait before restarting, recorded in `recent`; or
        None to give up (then `recent` holds the restarts the window still counts, so the
        child died `len(recent) + 1` times within it)."""
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            return None
        delay = self.backoff.delay(len(recent))
        recent.append(now)
        return delay
