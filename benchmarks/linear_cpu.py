"""CPU linear layers at the model's shapes: which matmul form is fastest at which row count.

Times one forward pass worth of linears (every decoder layer's QKV, O, gate/up and down
projections, separate weights per layer so they stream from memory as in a real pass) and
the LM head, for several row counts (tokens in the step), in float32 and bfloat16:

  F.linear     torch's default (MKL / oneDNN through aten)
  W@x^T        torch.mm(weight, x^T) (one row padded to two: a matrix-vector product is slow)
  onednn       torch.ops.mkldnn._linear_pointwise on the plain weight (reordered per call)
  packed       the same on a weight reordered once (services/worker/layers/packed_weight.py)

    .venv/bin/python -m benchmarks.linear_cpu [--model NAME] [--rows 1,2,8,64,256,1024]

It prints ms per pass (median of interleaved rounds) and GFLOP/s; packed_weight.py's choice
of the packed path at every row count comes from this table.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.ceiling import ModelShapes
from benchmarks.micro import interleaved
from services.common.config import DEFAULT_MODEL

FORMS = ("F.linear", "W@x^T", "onednn", "packed")


def _form(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    onednn = torch.ops.mkldnn._linear_pointwise
    if name == "F.linear":
        return lambda x, w, _packed: F.linear(x, w)
    if name == "W@x^T":
        return lambda x, w, _packed: torch.mm(w, (torch.cat([x, x]) if len(x) == 1 else x).t())
    if name == "onednn":
        return lambda x, w, _packed: onednn(x, w, None, "none", [], "")
    return lambda x, _w, packed: onednn(x, packed, None, "none", [], "")


def _weights(shapes: list[tuple[int, int]], copies: int, dtype: torch.dtype):
    """[(weight [out, in], packed)] for `copies` layers of every (in, out) shape."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    out = []
    for _ in range(copies):
        for fan_in, fan_out in shapes:
            weight = (torch.randn(fan_out, fan_in) * fan_in**-0.5).to(dtype)
            out.append((weight, reorder(weight)))
    return out


def time_forms(weights, rows: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """Median seconds per pass over `weights` for each form, rounds interleaved."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w, _ in weights}

    def passes(form):
        def call():
            for weight, packed in weights:
                form(inputs[weight.shape[1]], weight, packed)

        return call

    samples = interleaved({name: passes(_form(name)) for name in FORMS}, rounds)
    return {name: statistics.median(times) for name, times in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rows", default="1,2,4,8,64,256,1024")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    opts = parser.parse_args(argv)
    from services.common.model_source import resolve_model
    from services.worker.model_loader import load_config

    torch.set_num_threads(opts.threads)
    shapes = ModelShapes.from_config(load_config(resolve_model(opts.model)))
    parts = {
        "layers": (shapes.layer_linears(), shapes.num_layers),
        "lm head": ([(shapes.hidden_size, shapes.vocab_size)], 1),
    }
    print(f"torch {torch.__version__}, {opts.threads} threads; ms per pass (GFLOP/s)")
    print(f"{'part':8s} {'dtype':9s} {'rows':>5s}" + "".join(f"{n:>18s}" for n in FORMS))
    for dtype in (torch.float32, torch.bfloat16):
        for part, (part_shapes, copies) in parts.items():
            weights = _weights(part_shapes, copies, dtype)
            flops_per_row = 2 * copies * sum(i * o for i, o in part_shapes)
            for rows in (int(r) for r in opts.rows.split(",")):
                times = time_forms(weights, rows, dtype, opts.rounds)
                cells = "".join(
                    f"{f'{t * 1e3:.1f} ({rows * flops_per_row / t / 1e9:.0f})':>18s}"
                    for t in times.values()
                )
                print(f"{part:8s} {str(dtype)[6:]:9s} {rows:5d}{cells}", flush=True)


if __name__ == "__main__":
    main()
