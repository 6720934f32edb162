"""The mp launcher's ranks, with stand-in worker commands: each rank's share of the cores
travels on its command line, the addresses come back in rank order, a rank that exits is
named, and closing stops every rank."""

import signal
import sys
from pathlib import Path

import pytest

from services.scheduler.launchers import mp_launcher
from services.scheduler.launchers.launcher import WorkerStartError
from services.scheduler.launchers.mp_launcher import MpLauncher
from tests.helpers.processes import gone

# Writes its "address" to the ready file, then sleeps until stopped.
SERVE = (
    "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text(sys.argv[2]); time.sleep(60)"
)


def _stand_in(calls: list):
    def command(rank: int, rendezvous: str, ready: Path, cores: str | None) -> list[str]:
        calls.append((rank, rendezvous, cores))
        return [sys.executable, "-c", SERVE, str(ready), f"127.0.0.1:{5000 + rank}"]

    return command


def test_each_rank_gets_its_cores_on_its_command_line(monkeypatch):
    monkeypatch.setattr(mp_launcher, "rank_shares", lambda world, per_rank: [[0, 1], [2, 3]])
    calls = []
    launcher = MpLauncher(2, _stand_in(calls), threads_per_rank=2)
    try:
        assert launcher.start(timeout_s=60) == ["127.0.0.1:5000", "127.0.0.1:5001"]
        assert [(rank, cores) for rank, _, cores in calls] == [(0, "0,1"), (1, "2,3")]
        assert calls[0][1] == calls[1][1] and calls[0][1].startswith("file://")
        pids = launcher.pids
        assert len(pids) == 2
        launcher.check_alive()
    finally:
        launcher.close()
    assert gone(pids) and not launcher.folder.exists()


def test_a_machine_too_small_to_split_gives_no_cores(monkeypatch):
    monkeypatch.setattr(mp_launcher, "rank_shares", lambda world, per_rank: [])
    calls = []
    launcher = MpLauncher(2, _stand_in(calls), threads_per_rank=2)
    try:
        launcher.start(timeout_s=60)
    finally:
        launcher.close()
    assert [cores for _, _, cores in calls] == [None, None]


def test_a_rank_that_exits_is_named():
    def command(rank: int, rendezvous: str, ready: Path, cores: str | None) -> list[str]:
        if rank == 1:
            return [sys.executable, "-c", "raise SystemExit(3)"]
        return [sys.executable, "-c", SERVE, str(ready), "127.0.0.1:5000"]

    launcher = MpLauncher(2, command, threads_per_rank=1)
    with pytest.raises(WorkerStartError, match=r"worker rank 1 \(pid \d+\) exited with 3"):
        launcher.start(timeout_s=60)
    assert launcher.pids == [] and not launcher.folder.exists()  # the survivor was stopped


def test_a_rank_that_dies_later_is_named_by_check_alive():
    launcher = MpLauncher(1, _stand_in([]), threads_per_rank=1)
    try:
        launcher.start(timeout_s=60)
        launcher.supervisor.children[0].process.send_signal(signal.SIGKILL)
        launcher.supervisor.children[0].process.wait(timeout=10)
        with pytest.raises(WorkerStartError, match=r"worker rank 0 .* its log above says why"):
            launcher.check_alive()
    finally:
        launcher.close()
