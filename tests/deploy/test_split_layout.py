"""The roles `serve --split-services` / `--data-parallel-size` starts, as command lines:
one worker group and scheduler per replica, devices never shared, and one frontend that
routes over every scheduler with the router flags passed on."""

import pytest

from pagestream.cli import build_parser
from pagestream.split_layout import SplitLayout, run_split, split_roles


def _argv_of(role) -> list[str]:
    return role.command(0)


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_two_replicas_of_two_ranks_get_their_own_devices_ports_and_schedulers():
    ns = build_parser().parse_args(
        ["serve", "some-model", "-dp", "2", "-tp", "2", "--router-policy", "least_loaded"]
    )
    layout = SplitLayout.create(world_size=2, data_parallel_size=2)
    roles = split_roles(ns, layout)
    names = [r.name for r in roles]
    assert names == [
        "worker rank 0 of replica 0",
        "worker rank 1 of replica 0",
        "scheduler of replica 0",
        "worker rank 0 of replica 1",
        "worker rank 1 of replica 1",
        "scheduler of replica 1",
        "frontend",
    ]
    workers = [_argv_of(r) for r in roles if r.name.startswith("worker")]
    assert [_flag_values(w, "--local-rank") for w in workers] == [["0"], ["1"], ["2"], ["3"]]
    assert [_flag_values(w, "--rank") for w in workers] == [["0"], ["1"], ["0"], ["1"]]
    rendezvous = [_flag_values(w, "--dist-init-method")[0] for w in workers]
    assert rendezvous[0] == rendezvous[1] != rendezvous[2] == rendezvous[3]
    assert {r.group for r in roles if r.name.startswith("worker")} == {"workers-0", "workers-1"}
    schedulers = [_argv_of(r) for r in roles if r.name.startswith("scheduler")]
    for replica, scheduler in enumerate(schedulers):
        ports = layout.worker_ports[replica]
        assert _flag_values(scheduler, "--worker") == [f"127.0.0.1:{p}" for p in ports]
    frontend = _argv_of(roles[-1])
    assert _flag_values(frontend, "--scheduler") == [
        f"127.0.0.1:{p}" for p in layout.scheduler_ports
    ]
    assert _flag_values(frontend, "--router-policy") == ["least_loaded"]
    every_port = [p for ports in layout.worker_ports for p in ports] + layout.scheduler_ports
    assert len(set(every_port)) == len(every_port) == 6


def test_one_replica_of_one_rank_needs_no_rendezvous():
    ns = build_parser().parse_args(["serve", "some-model", "--split-services"])
    roles = split_roles(ns, SplitLayout.create(world_size=1))
    worker = _argv_of(roles[0])
    assert "--dist-init-method" not in worker and _flag_values(worker, "--local-rank") == ["0"]
    assert len(_flag_values(_argv_of(roles[-1]), "--scheduler")) == 1


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["serve", "m", "-dp", "0", "--split-services"], "--data-parallel-size"),
        (["serve", "m", "-dp", "2", "--router-cache-threshold", "2"], "router_cache_threshold"),
    ],
)
def test_bad_data_parallel_and_router_flags_fail_before_anything_starts(argv, flag):
    with pytest.raises(ValueError, match=flag):
        run_split(build_parser().parse_args(argv))
