"""RestartPolicy: backoff by recent restarts, and a give-up past `max_restarts` per window."""

from collections import deque

from services.common.backoff import Backoff
from services.common.restart_policy import RestartPolicy

POLICY = RestartPolicy(Backoff((1.0, 2.0, 4.0)), max_restarts=3, window_s=300.0)


def test_restarts_back_off_then_give_up_past_the_limit():
    recent: deque[float] = deque()
    delays = [POLICY.next_delay(recent, now) for now in (0.0, 10.0, 20.0, 30.0)]
    assert delays == [1.0, 2.0, 4.0, None]
    assert list(recent) == [0.0, 10.0, 20.0]  # a give-up records nothing


def test_restarts_older_than_the_window_are_forgotten():
    recent: deque[float] = deque([0.0, 10.0, 20.0])
    assert POLICY.next_delay(recent, 305.0) == 4.0  # the restart at 0 s left the window
    assert list(recent) == [10.0, 20.0, 305.0]
    assert POLICY.next_delay(recent, 1000.0) == 1.0  # a quiet spell starts the ramp over
    assert list(recent) == [1000.0]
