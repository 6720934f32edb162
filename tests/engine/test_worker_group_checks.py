"""Start-up checks of worker groups that need no process group: a worker's rank and
rendezvous from flags or torchrun's environment, the scheduler's --worker count, a rank
in the wrong place, and the launch-backend combinations; each message names the flag."""

import argparse

import pytest

from pagestream.cli import build_parser
from pagestream.engine_args import EngineArgs
from pagestream.roles import worker_group_rank
from services.common.config import ParallelConfig
from services.common.flags import from_flags, to_flags
from services.common.worker_info import ModelInfo
from services.scheduler.executor.worker_group import WorkerGroupExecutor

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def _worker(argv: list[str]) -> tuple[argparse.Namespace, EngineArgs]:
    ns = build_parser().parse_args(["worker", "m", *argv])
    args = from_flags(EngineArgs, ns)
    return ns, args


def test_rank_and_rendezvous_from_flags():
    ns, args = _worker(["-tp", "2", "--rank", "1", "--dist-init-method", "file:///tmp/x"])
    group = worker_group_rank(ns, args)
    assert (group.rank.rank, group.rank.world_size, group.init_method) == (1, 2, "file:///tmp/x")


def test_rank_and_rendezvous_from_torchrun_env(monkeypatch):
    env = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="w0", MASTER_PORT="29500")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    group = worker_group_rank(*_worker(["-tp", "2", "-pp", "2"]))
    assert (group.rank.rank, group.rank.tp_rank, group.rank.pp_rank) == (3, 1, 1)
    assert (group.init_method, group.local_rank) == ("tcp://w0:29500", 1)


def test_world_size_mismatch_names_both_sides(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 .* --tensor-parallel-size 2"):
        worker_group_rank(*_worker(["-tp", "2", "--dist-init-method", "file:///tmp/x"]))


def test_a_group_rank_needs_a_rendezvous():
    with pytest.raises(ValueError, match=r"--dist-init-method .* MASTER_ADDR"):
        worker_group_rank(*_worker(["-tp", "2", "--rank", "0"]))


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank must be in"):
        worker_group_rank(*_worker(["-tp", "2", "--rank", "2", "--dist-init-method", "x://"]))


def test_wrong_number_of_worker_addresses_names_the_flags():
    with pytest.raises(ValueError, match=r"--worker was given 1 address.* needs 2"):
        WorkerGroupExecutor(["127.0.0.1:1"], tensor_parallel_size=2)


def test_a_rank_in_the_wrong_place_is_refused():
    executor = WorkerGroupExecutor(["127.0.0.1:1", "127.0.0.1:2"], tensor_parallel_size=2)
    try:
        info = ModelInfo("m", "Llama", "float32", "cpu", 2, 1, 16, 512, (2,), 256, 0, 2, 2, 1)
        executor._check_place(executor.ranks[0], info)  # where it belongs
        with pytest.raises(ValueError, match=r"says it is rank 0 .* make it rank 1 of 2"):
            executor._check_place(executor.ranks[1], info)
    finally:
        executor.close()


def test_uni_cannot_hold_a_group():
    with pytest.raises(ValueError, match=r"--distributed-executor-backend uni .* needs 2 workers"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    assert ParallelConfig(pipeline_parallel_size=2).backend == "mp"
    assert ParallelConfig().backend == "uni"


def test_cli_flags_round_trip():
    ns = build_parser().parse_args(["serve", "m", "-tp", "2", "-pp", "3", "--async-scheduling"])
    args = from_flags(EngineArgs, ns)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    flags = to_flags(args)
    start = flags.index("--tensor-parallel-size")
    assert flags[start : start + 5] == [
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "3", "--async-scheduling",
    ]  # fmt: skip
    assert from_flags(EngineArgs, build_parser().parse_args(["serve", "m", *flags])) == args
