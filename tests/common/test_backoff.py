"""Backoff: one wait per attempt, the last step repeating."""

import pytest

from services.common.backoff import Backoff


def test_each_attempt_waits_its_step_and_later_ones_the_last():
    backoff = Backoff((0.0, 0.25, 0.5))
    assert [backoff.delay(attempt) for attempt in range(5)] == [0.0, 0.25, 0.5, 0.5, 0.5]


def test_one_step_is_a_constant_wait():
    assert Backoff((2.0,)).delay(0) == Backoff((2.0,)).delay(9) == 2.0


@pytest.mark.parametrize("steps", [(), (1.0, -0.5)])
def test_empty_or_negative_steps_are_refused(steps):
    with pytest.raises(ValueError, match="backoff steps"):
        Backoff(steps)
