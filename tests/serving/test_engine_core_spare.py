"""SparePool (pagestream/engine_core_spare.py): a spare interpreter runs the command it is
handed, under the environment handed with it, in the spare's own pid; a spare made for
other import-time settings is not used; a closed pool's spare exits by itself."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from pagestream.engine_core_spare import SparePool

TIMEOUT_S = 120.0


def _command(out) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.env_echo", "SPARE_TEST_VALUE", str(out)]


def _wait_ready(pool: SparePool) -> None:
    """The spare is alive (its imports may still run: take() waits for nothing)."""
    pool.refill()
    assert pool._spare is not None and pool._spare.poll() is None


def test_the_spare_runs_the_command_under_the_given_environment(tmp_path):
    pool = SparePool(dict(os.environ))
    try:
        _wait_ready(pool)
        spare_pid = pool._spare.pid
        env = dict(os.environ, SPARE_TEST_VALUE="handed over")
        process = pool.take(_command(tmp_path / "out.json"), env, None)
        assert process.pid == spare_pid
        assert process.wait(timeout=TIMEOUT_S) == 0
        seen = json.loads((tmp_path / "out.json").read_text())
        assert seen["value"] == "handed over"
        assert seen["pid"] == spare_pid
        assert seen["argv"][1:] == ["SPARE_TEST_VALUE", str(tmp_path / "out.json")]
        assert pool._spare is None  # taken: the next one starts at refill()
    finally:
        pool.close()


@pytest.mark.parametrize("changed", ["OMP_NUM_THREADS", "PYTHONPATH"])
def test_a_spare_made_for_other_import_settings_is_not_used(tmp_path, changed):
    pool = SparePool(dict(os.environ))
    try:
        _wait_ready(pool)
        spare = pool._spare
        env = dict(os.environ, **{changed: "7" if changed == "OMP_NUM_THREADS" else os.getcwd()})
        process = pool.take(_command(tmp_path / "out.json"), env, None)
        assert process.pid != spare.pid
        assert process.wait(timeout=TIMEOUT_S) == 0
        assert spare.wait(timeout=TIMEOUT_S) == 0  # discarded: EOF, it exits
    finally:
        pool.close()


def test_a_closed_pool_leaves_no_spare(tmp_path):
    pool = SparePool(dict(os.environ))
    _wait_ready(pool)
    spare = pool._spare
    pool.close()
    assert spare.wait(timeout=TIMEOUT_S) == 0
    pool.refill()  # closed: starts nothing
    assert pool._spare is None


def test_a_dead_spare_is_replaced_by_a_fresh_process(tmp_path):
    pool = SparePool(dict(os.environ))
    try:
        _wait_ready(pool)
        spare = pool._spare
        spare.kill()
        spare.wait(timeout=TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while spare.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process = pool.take(_command(tmp_path / "out.json"), dict(os.environ), None)
        assert process.pid != spare.pid and process.wait(timeout=TIMEOUT_S) == 0
        assert json.loads((tmp_path / "out.json").read_text())["pid"] == process.pid
    finally:
        pool.close()
