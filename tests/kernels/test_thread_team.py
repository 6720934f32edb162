"""The native step's thread team (pagestream_kernels/cpu/thread_pool.cpp) with more threads
than a run has chunks: a worker a run leaves out must not touch that run (before the fix it
read the shared chunk count and, waking late, could run a chunk of the next run a second
time after its caller had returned). Runs in a child process, since the team size and the
threads' pinning are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, torch
    from pagestream_kernels import cpu
    module = cpu.load()
    allowed = sorted(os.sched_getaffinity(0))
    team = (allowed * 4)[:4]  # a team of 4 whatever the core count: runs of 2-4 chunks
    assert module.pin_threads(team) == 4
    gen = torch.Generator().manual_seed(0)
    # Q4_K blocks of 144 bytes; decode_q4_k splits N blocks into ceil(N / 64) chunks.
    sizes = (65, 130, 200, 256, 64)  # 2, 3, 4, 4 chunks, and one run inline
    raws = {n: torch.randint(0, 256, (n, 144), dtype=torch.uint8, generator=gen) for n in sizes}
    bits = lambda out: [t.view(torch.uint8).clone() for t in out]  # random scales: NaNs too
    want = {n: bits(module.decode_q4_k(raws[n])) for n in sizes}
    for i in range(4000):
        n = sizes[i % len(sizes)]
        assert all(map(torch.equal, bits(module.decode_q4_k(raws[n])), want[n])), (i, n)
    print("ok")
    """
)


def test_a_team_larger_than_a_run_leaves_the_run_to_its_chunks():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
