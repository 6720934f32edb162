"""What one collective of a tensor-/pipeline-parallel step costs on this machine (gloo, CPU).

``world_size`` local processes meet through a file rendezvous, as the engine's `mp` ranks do,
each with an equal share of the cores, and rank 0 times, in microseconds (median and minimum
over barrier-aligned calls: idle peers, no skew): the ``all_reduce`` of ``[num_tokens,
hidden]`` (``2 * layers + 1`` per step under tp), the ``gather`` of ``[rows, vocab / world]``
logits (once per step), the ``send``/``recv`` of ``[num_tokens, hidden]`` (once per stage
boundary under pp), and all-reduces inside a step: the model's sharded linears with and
without their two all-reduces per layer, turn about (the difference per all-reduce).

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
_RANK = "import sys; from benchmarks.collectives import run_rank; run_rank(*sys.argv[1:])"


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
        argv = [sys.executable, "-c", _RANK, init_method, json.dumps(asdict(spec)), str(out)]
        pipe = {"env": env, "stderr": subprocess.PIPE, "text": True}
        ranks = [subprocess.Popen([*argv, str(i)], **pipe) for i in range(spec.world_size)]
        errors = []
        for rank, process in enumerate(ranks):
            try:
                _, stderr = process.communicate(timeout=TIMEOUT_S * 2)
            except subprocess.TimeoutExpired:
                process.kill()
                _, stderr = process.communicate()
            if process.returncode:
                stderr = stderr.strip()[-500:]
                errors.append(f"rank {rank} exited with {process.returncode}: {stderr}")
        if errors:
            raise RuntimeError("collective timings failed: " + "; ".join(errors))
        timings = json.loads(out.read_text(encoding="utf-8"))
    return {**asdict(spec), "threads_per_rank": spec.threads(), **timings}


def run_rank(init_method: str, spec_json: str, out: str, rank: str) -> None:
    """One rank's side (its own process): join the group, time, rank 0 writes ``out``."""
    import datetime

    import torch
    import torch.distributed as dist

    fields = json.loads(spec_json).items()
    spec = CollectiveSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields})
    torch.set_num_threads(spec.threads())
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method, timeout, spec.world_size, int(rank))
    timings = _time_all(int(rank), spec)
    dist.destroy_process_group()
    if int(rank) == 0:
        Path(out).write_text(json.dumps(timings), encoding="utf-8")


def _timed(call, spec: CollectiveSpec, tensor) -> dict[str, float]:
    """Median and minimum microseconds of ``call`` over barrier-aligned calls (after 2
    warm-ups; fewer for the large tensors)."""
    import torch.distributed as dist

    repeats = max(3, min(spec.repeats, spec.max_bytes_per_size // max(tensor.nbytes, 1)))
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

    world = spec.world_size
    all_reduce, send_recv, gather = {}, {}, {}
    for n in spec.token_counts:
        x = torch.randn(n, spec.hidden_size)  # [num_tokens, hidden_size]
        all_reduce[n] = _timed(lambda x=x: dist.all_reduce(x), spec, x)
        if world >= 2:  # rank 0 -> rank 1, as one stage hands the next its hidden states
            hop = {0: lambda x=x: dist.send(x, dst=1), 1: lambda x=x: dist.recv(x, src=0)}
            send_recv[n] = _timed(hop.get(rank, lambda: None), spec, x)
    for rows in spec.gather_rows:
        logits = torch.randn(rows, -(-spec.vocab_size // world))  # [rows, vocab / world]
        parts = [torch.empty_like(logits) for _ in range(world)] if rank == 0 else None
        gather[rows] = _timed(lambda lg=logits, p=parts: dist.gather(lg, p, dst=0), spec, logits)
    timings = {"all_reduce_us": all_reduce, "send_recv_us": send_recv, "gather_logits_us": gather}
    if spec.num_layers:
        timings["all_reduce_in_step_us"] = _time_in_step(spec)
    return timings


def _time_in_step(spec: CollectiveSpec) -> dict:
    """Per token count: a step's linears with and without their all-reduces (medians, ms,
    measured turn about) and the difference per all-reduce (us)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    world, hidden, inter = spec.world_size, spec.hidden_size, spec.intermediate_size
    g = torch.Generator().manual_seed(0)
    # this rank's shards: column-parallel QKV and gate/up, row-parallel o and down
    shapes = [(spec.qkv_size // world, hidden), (hidden, spec.q_size // world)]
    shapes += [(2 * inter // world, hidden), (hidden, inter // world)]
    layers = [[torch.randn(s, generator=g) * 0.02 for s in shapes] for _ in range(spec.num_layers)]

    def step(x, reduce: bool) -> None:
        for qkv, o, gate_up, down in layers:
            attn = F.linear(F.linear(x, qkv)[:, : o.shape[1]], o)  # [n, hidden], a partial sum
            if reduce:
                dist.all_reduce(attn)
            x = x + attn
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            mlp = F.linear(F.silu(gate) * up, down)  # [n, hidden], a partial sum
            if reduce:
                dist.all_reduce(mlp)
            x = x + mlp

    out = {}
    for n in spec.step_token_counts:
        x = torch.randn(n, hidden)
        samples: dict[bool, list[float]] = {False: [], True: []}
        step(x, True)  # warm-up (and oneDNN's primitives for these shapes)
        for _ in range(max(3, spec.step_repeats * 32 // max(n, 32))):
            for reduce in (False, True):
                dist.barrier()
                start = time.perf_counter()
                step(x, reduce)
                samples[reduce].append(time.perf_counter() - start)
        with_ms, without_ms = (statistics.median(samples[r]) * 1e3 for r in (True, False))
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
    args = parser.parse_args(argv)
    sizes = (args.world_size, args.hidden_size, args.vocab_size)
    spec = CollectiveSpec(*sizes, repeats=args.repeats, num_layers=args.num_layers)
    print(json.dumps(measure_collectives(spec), indent=1))


if __name__ == "__main__":
    main()
