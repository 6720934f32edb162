"""The short soak (benchmarks/soak.py): mixed traffic against the split deployment (streams,
cancels, n > 1, beam search, shared prefixes, preemption on a small cache, bad inputs) for
a few seconds: no request is lost, nothing is left in the engine, memory does not run away.
The long run is `python -m benchmarks.soak` (docs/operations.md has its last result)."""

from benchmarks.soak import KINDS, soak


def test_short_soak_loses_nothing_and_leaks_nothing(model_dir):
    flags = ["--kv-cache-memory", "128KiB", "--swap-space", "0.01"]
    report = soak(str(model_dir("llama")), duration_s=15, clients=4, engine_flags=flags)
    assert report.lost == [] and report.timed_out == 0
    assert set(report.requests) == set(KINDS)  # every kind of request ran
    assert report.engine_after["num_running_reqs"] == 0
    assert report.engine_after["num_waiting_reqs"] == 0
    assert report.engine_after["kv_cache_usage"] == 0.0  # no leaked block
    assert report.engine_after["num_preemptions"] > 0  # the small cache forced preemption
    # 15 s includes warm-up; a leak of every request's state would grow far faster.
    assert all(growth < 2.0 for growth in report.rss_growth.values()), report.rss_mib
    assert report.ok
