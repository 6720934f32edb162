"""The supervisor of every child process (split roles, the engine-core child, mp ranks): a
child that dies is restarted (its restart group with it, each time with a new generation),
a child that keeps dying is given up on, children stop last started first, and readiness
waits fail fast on a child that exits."""

import os
import signal
import sys
import threading

import pytest

from services.common.backoff import Backoff
from services.common.supervisor import Child, ChildExited, Supervisor
from tests.helpers.eventually import eventually

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASHER = [sys.executable, "-c", "raise SystemExit(3)"]


FAST = Backoff((0.05,))


@pytest.fixture(autouse=True)
def no_signal_handlers(monkeypatch):
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
        Child("rank 0", ranked, group="workers"),
        Child("rank 1", ranked, group="workers"),
        Child("frontend", lambda _: SLEEPER),
    ]
    sup = Supervisor(roles, grace_s=2, backoff=FAST)
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
    roles = [Child("crasher", lambda _: CRASHER), Child("other", lambda _: SLEEPER)]
    sup = Supervisor(roles, max_restarts=2, grace_s=2, backoff=FAST)
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
    sup = Supervisor([Child(n, lambda _, n=n: recorder(n)) for n in names], grace_s=5, backoff=FAST)
    thread, result = _run_in_thread(sup)
    try:
        eventually(lambda: all((tmp_path / n).exists() for n in names))  # handlers are set
    finally:
        sup.stop()
        thread.join(timeout=30)
    assert result == [0]
    assert log.read_text().split() == ["frontend", "scheduler", "worker"]


def _exit_with(generation: int) -> None:
    raise SystemExit(4 + generation)


def test_a_target_child_runs_in_a_process_and_a_readiness_wait_sees_it_exit():
    child = Child("target", target=_exit_with)
    sup = Supervisor([child])
    sup.start()
    with pytest.raises(ChildExited, match=r"target \(pid \d+\) exited with 4") as caught:
        sup.wait_ready(child, lambda: None, timeout_s=60)
    assert caught.value.code == 4
    with pytest.raises(ChildExited):
        sup.check_alive()


def test_a_readiness_wait_returns_the_probe_result_or_times_out():
    child = Child("sleeper", lambda _: SLEEPER)
    sup = Supervisor([child], grace_s=2)
    sup.start()
    try:
        sup.check_alive()
        with pytest.raises(TimeoutError, match=r"sleeper was not ready within 0\.2s"):
            sup.wait_ready(child, lambda: None, timeout_s=0.2)
        assert sup.wait_ready(child, lambda: "127.0.0.1:5", timeout_s=1) == "127.0.0.1:5"
    finally:
        assert sup.stop_all() == [-signal.SIGTERM]


def test_a_child_is_a_command_or_a_target():
    with pytest.raises(ValueError, match="exactly one"):
        Child("neither")


def test_a_target_child_is_restarted_with_its_next_generation():
    child = Child("target", target=_exit_with)
    sup = Supervisor([child], max_restarts=1, grace_s=2, backoff=FAST)
    thread, result = _run_in_thread(sup)
    thread.join(timeout=60)
    assert result == [1] and sup.gave_up == "target"
    assert child.generation == 1 and child.exit_code() == 5  # target(1) ran
