"""What one collective of a tensor-/pipeline-parallel step costs on this machine (gloo, CPU).

Starts ``world_size`` local processes (`python -m benchmarks.collectives --rank R ...`) that
meet through a file rendezvous, as the engine's `mp` ranks do, each with an equal share of
the cores (torch threads), and times on rank 0:

- ``all_reduce`` of a ``[num_tokens, hidden_size]`` float32 tensor: what every row-parallel
  layer (o_proj, down_proj) and the vocab-parallel embedding do, ``2 * layers + 1`` times
  per step under tensor parallelism;
- ``gather`` of ``[num_rows, vocab_size / world_size]`` float32 logits to rank 0: the LM
  head's, once per step, one row per sampled sequence;
- ``send``/``recv`` of a ``[num_tokens, hidden_size]`` tensor: the hidden states one
  pipeline stage hands the next, once per step and stage boundary;
- all-reduces *inside a step*: every rank runs the model's linear layers on its shard of
  the weights (``layers`` x QKV, o_proj, gate/up, down_proj), with and without the two
  all-reduces per layer, turn about; the difference per all-reduce is what one costs
  between two busy processes (wake-ups and the peer's lag included), which is what a
  tensor-parallel step pays.

Every timed call starts right after a barrier, so the figures are the collective's own cost
(idle peers, no skew); in a real step a rank also waits for the slowest peer's compute.
Microseconds: the median and the minimum of each size's calls (on a shared machine the
median carries the other jobs' noise; the minimum is the uncontended cost).

    python -m benchmarks.collectives --world-size 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TIMEOUT_S = 120.0
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CollectiveSpec:
    world_size: int = 2
    hidden_size: int = 576
    vocab_size: int = 49152
    token_counts: tuple[int, ...] = (1, 8, 32, 128, 512, 2048)  # decode ... a prefill chunk
    gather_rows: tuple[int, ...] = (1, 8, 32, 128)  # sampled rows per step
    # The in-step timing: the model's linear shapes (0 layers: skipped).
    num_layers: int = 0
    intermediate_size: int = 1536
    qkv_size: int = 960  # (query heads + 2 * KV heads) * head_dim
    q_size: int = 576  # query heads * head_dim (o_proj's input)
    step_token_counts: tuple[int, ...] = (1, 8, 32, 128, 512, 2048)
    step_repeats: int = 10
    repeats: int = 40
    max_bytes_per_size: int = 64 * 1024**2  # fewer repeats for the large tensors
    threads_per_rank: int = 0  # 0: cores // world_size (what the mp backend gives a rank)

    def threads(self) -> int:
        return self.threads_per_rank or max(1, (os.cpu_count() or 1) // self.world_size)


def measure_collectives(spec: CollectiveSpec) -> dict:
    """Run the timings in ``spec.world_size`` fresh processes; rank 0's figures (us)."""
    with tempfile.TemporaryDirectory(prefix="pagestream-collectives-") as folder:
        init_method = f"file://{Path(folder) / 'rendezvous'}"
        out = Path(folder) / "rank0.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(spec.threads()))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        processes = [
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "benchmarks.collectives", "--rank", str(rank)),
                    *("--init-method", init_method, "--spec", json.dumps(asdict(spec))),
                    *("--out", str(out)),
                ],
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(spec.world_size)
        ]
        errors = [_wait(rank, process) for rank, process in enumerate(processes)]
        if any(errors):
            raise RuntimeError("collective timings failed: " + "; ".join(filter(None, errors)))
        timings = json.loads(out.read_text(encoding="utf-8"))
    return {**asdict(spec), "threads_per_rank": spec.threads(), **timings}


def _wait(rank: int, process: subprocess.Popen) -> str | None:
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S * 2)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
    if process.returncode == 0:
        return None
    return f"rank {rank} exited with {process.returncode}: {stderr.strip()[-500:]}"


def run_rank(rank: int, init_method: str, spec: CollectiveSpec, out: Path | None) -> None:
    """One rank's side (its own process): join the group, time, rank 0 writes ``out``."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads())
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    timings = _time_all(rank, spec)
    dist.destroy_process_group()
    if rank == 0 and out is not None:
        out.write_text(json.dumps(timings), encoding="utf-8")


def _repeats(spec: CollectiveSpec, num_bytes: int) -> int:
    return max(3, min(spec.repeats, spec.max_bytes_per_size // max(num_bytes, 1)))


def _timed(call, repeats: int) -> dict[str, float]:
    """Median and minimum microseconds of ``call`` over ``repeats`` barrier-aligned calls
    (after 2 warm-ups)."""
    import torch.distributed as dist

    samples = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        call()
        if i >= 2:
            samples.append(time.perf_counter() - start)
    return {
        "median": round(statistics.median(samples) * 1e6, 1),
        "min": round(min(samples) * 1e6, 1),
    }


def _time_all(rank: int, spec: CollectiveSpec) -> dict:
    import torch
    import torch.distributed as dist

    world, hidden = spec.world_size, spec.hidden_size
    all_reduce, send_recv, gather = {}, {}, {}
    for n in spec.token_counts:
        x = torch.randn(n, hidden)  # [num_tokens, hidden_size]
        all_reduce[n] = _timed(lambda x=x: dist.all_reduce(x), _repeats(spec, x.nbytes))
        if world >= 2:  # rank 0 -> rank 1, as one stage hands the next its hidden states

            def hop(x=x):
                if rank == 0:
                    dist.send(x, dst=1)
                elif rank == 1:
                    dist.recv(x, src=0)

            send_recv[n] = _timed(hop, _repeats(spec, x.nbytes))
    shard = -(-spec.vocab_size // world)
    for rows in spec.gather_rows:
        logits = torch.randn(rows, shard)  # [num_rows, vocab_size / world_size]
        parts = [torch.empty_like(logits) for _ in range(world)] if rank == 0 else None
        gather[rows] = _timed(
            lambda lg=logits, p=parts: dist.gather(lg, p, dst=0), _repeats(spec, logits.nbytes)
        )
    timings = {"all_reduce_us": all_reduce, "send_recv_us": send_recv, "gather_logits_us": gather}
    if spec.num_layers:
        timings["all_reduce_in_step_us"] = _time_in_step(spec)
    return timings


def _time_in_step(spec: CollectiveSpec) -> dict:
    """Per token count: a step's linears with and without their all-reduces (medians, ms,
    measured turn about) and the difference per all-reduce (us)."""
    import torch
    import torch.nn.functional as F

    world, hidden = spec.world_size, spec.hidden_size
    g = torch.Generator().manual_seed(0)
    layers = [
        {  # this rank's shards: column-parallel QKV and gate/up, row-parallel o and down
            "qkv": torch.randn(spec.qkv_size // world, hidden, generator=g) * 0.02,
            "o": torch.randn(hidden, spec.q_size // world, generator=g) * 0.02,
            "gate_up": torch.randn(2 * spec.intermediate_size // world, hidden, generator=g) * 0.02,
            "down": torch.randn(hidden, spec.intermediate_size // world, generator=g) * 0.02,
        }
        for _ in range(spec.num_layers)
    ]

    def step(x, reduce: bool) -> None:
        import torch.distributed as dist

        for w in layers:
            q = F.linear(x, w["qkv"])[:, : w["o"].shape[1]]  # [n, q_size / world]
            attn = F.linear(q, w["o"])  # [n, hidden], a partial sum
            if reduce:
                dist.all_reduce(attn)
            x = x + attn
            gate, up = F.linear(x, w["gate_up"]).chunk(2, dim=-1)
            mlp = F.linear(F.silu(gate) * up, w["down"])  # [n, hidden], a partial sum
            if reduce:
                dist.all_reduce(mlp)
            x = x + mlp

    out = {}
    for n in spec.step_token_counts:
        x = torch.randn(n, hidden)
        repeats = max(3, spec.step_repeats * 32 // max(n, 32))
        with_s, without_s = [], []
        step(x, True)  # warm-up (and oneDNN's primitives for these shapes)
        for _ in range(repeats):
            for reduce, samples in ((False, without_s), (True, with_s)):
                torch.distributed.barrier()
                start = time.perf_counter()
                step(x, reduce)
                samples.append(time.perf_counter() - start)
        with_ms, without_ms = statistics.median(with_s) * 1e3, statistics.median(without_s) * 1e3
        per_call = max(0.0, (with_ms - without_ms) * 1e3 / (2 * spec.num_layers))
        out[n] = {
            "with_ms": round(with_ms, 2),
            "without_ms": round(without_ms, 2),
            "per_call": round(per_call, 1),
        }
    return out


def interpolate_us(table: dict, num_tokens: float, stat: str = "median") -> float:
    """A collective's time at ``num_tokens`` rows, linear between the measured sizes (and
    flat below the smallest / proportional above the largest)."""
    points = sorted((int(k), float(v[stat])) for k, v in table.items())
    if not points:
        return 0.0
    if num_tokens <= points[0][0]:
        return points[0][1]
    for (n0, t0), (n1, t1) in itertools.pairwise(points):
        if num_tokens <= n1:
            return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0)
    n, t = points[-1]
    return t * num_tokens / n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument(
        "--num-layers", type=int, default=30, help="layers of the in-step timing (0: skip it)"
    )
    # One rank of a measurement (what measure_collectives starts).
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--init-method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        spec = CollectiveSpec(**{k: _tuple(v) for k, v in json.loads(args.spec).items()})
        run_rank(args.rank, args.init_method, spec, args.out)
        return
    spec = CollectiveSpec(
        world_size=args.world_size,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        repeats=args.repeats,
        num_layers=args.num_layers,
    )
    print(json.dumps(measure_collectives(spec), indent=1))


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


if __name__ == "__main__":
    main()
