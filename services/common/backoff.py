"""Backoff: how long to wait before each retry of something that keeps failing.

Each caller names its steps once, where it builds its policy; attempt 0 waits the first
step and every attempt past the last step waits the last (the steps are a ramp to a cap).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    steps: tuple[float, ...]  # seconds, one per attempt; the last repeats

    def __post_init__(self) -> None:
        if not self.steps or any(step < 0 for step in self.steps):
            raise ValueError(f"backoff steps must be non-empty and non-negative: {self.steps}")

    def delay(self, attempt: int) -> float:
        """The wait before retry `attempt` (0-based; counted since the last success)."""
        return self.steps[min(attempt, len(self.steps) - 1)]
