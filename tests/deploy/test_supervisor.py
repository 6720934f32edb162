"""The split deployment's supervisor: a child that dies is restarted (its restart group
with it, each time with a new generation), and a child that keeps dying is given up on."""

import os
import signal
import sys
import threading

import pytest

from pagestream import supervisor as supervisor_module
from pagestream.supervisor import Role, Supervisor
from services.common.backoff import Backoff
from tests.helpers.eventually import eventually

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASHER = [sys.executable, "-c", "raise SystemExit(3)"]


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(supervisor_module, "BACKOFF", Backoff((0.05,)))
    # run() installs signal handlers, which only the main thread may do.
    monkeypatch.setattr(signal, "signal", lambda *args: None)


def _run_in_thread(sup: Supervisor) -> tuple[threading.Thread, list]:
    result = []
    thread = threading.Thread(target=lambda: result.append(sup.run(poll_s=0.02)))
    thread.start()
    return thread, result


def test_a_killed_child_is_restarted_with_its_group():
    generations = []

    def ranked(generation: int) -> list[str]:
        generations.append(generation)
        return SLEEPER

    roles = [
        Role("rank 0", ranked, group="workers"),
        Role("rank 1", ranked, group="workers"),
        Role("frontend", lambda _: SLEEPER),
    ]
    sup = Supervisor(roles, grace_s=2)
    thread, result = _run_in_thread(sup)
    try:
        eventually(lambda: len(sup.pids) == 3)
        before = sup.pids
        os.kill(before["rank 1"], signal.SIGKILL)
        eventually(lambda: all(sup.pids[n] != before[n] for n in ("rank 0", "rank 1")))
        assert sup.pids["frontend"] == before["frontend"]  # not in the group: untouched
        assert sorted(generations) == [0, 0, 1, 1]  # a fresh rendezvous for the new group
    finally:
        sup.stop()
        thread.join(timeout=20)
    assert result == [0]
    for pid in sup.pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every child is gone (reaped)


def test_a_child_that_keeps_dying_is_given_up_on():
    roles = [Role("crasher", lambda _: CRASHER), Role("other", lambda _: SLEEPER)]
    sup = Supervisor(roles, max_restarts=2, grace_s=2)
    thread, result = _run_in_thread(sup)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result == [1] and sup.gave_up == "crasher"
    assert len(roles[0].restarts) == 2
    assert roles[1].process.poll() is not None  # everything was stopped


def test_stopping_stops_the_last_started_role_first(tmp_path):
    """The frontend goes first, then the scheduler, then the worker: a frontend draining
    its streams on SIGTERM still has an engine behind it."""
    log = tmp_path / "stopped"

    def recorder(name: str) -> list[str]:
        script = (
            "import signal, sys, time, pathlib\n"
            f"def bye(*_):\n    open({str(log)!r}, 'a').write({name!r} + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            f"pathlib.Path({str(tmp_path / name)!r}).touch()\n"
            "time.sleep(60)\n"
        )
        return [sys.executable, "-c", script]

    names = ["worker", "scheduler", "frontend"]
    sup = Supervisor([Role(n, lambda _, n=n: recorder(n)) for n in names], grace_s=5)
    thread, result = _run_in_thread(sup)
    try:
        eventually(lambda: all((tmp_path / n).exists() for n in names))  # handlers are set
    finally:
        sup.stop()
        thread.join(timeout=30)
    assert result == [0]
    assert log.read_text().split() == ["frontend", "scheduler", "worker"]
