"""Where a native CPU decode step's time goes: `python -m benchmarks.native_step_profile`.

Pure decode steps of `--batch` sequences at a context of `--context` tokens over a scratch
cache: the whole forward, the LM head and each part of the stack (`DecoderStack.profile()`),
the weight bytes a step streams, and `streaming_limit_ms`, their time at the read rate of a
1 GiB float32 sum on the same threads (the floor of a batch-1 decode step).

    python -m benchmarks.native_step_profile --dtype bfloat16 --batch 1 --context 300
    python -m benchmarks.native_step_profile --query-len 5  # verifying 4 proposals
    python -m benchmarks.native_step_profile --model FILE.gguf --dtype auto  # its own blocks
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.micro import read_bandwidth_gb_s
from pagestream_kernels.attention_metadata import AttentionMetadata
from services.common.config import ModelConfig
from services.worker.cpu_tuning import pin_threads
from services.worker.model_loader import load


def profile(
    dtype: str, batch: int, context: int, steps: int, query_len: int = 1, model_path: str = ""
) -> dict:
    """`steps` timed steps of `batch` sequences of `context` tokens, each running its last
    `query_len` (1: a decode step; more: verifying query_len - 1 speculative proposals)."""
    loaded = load(ModelConfig(model_path, dtype) if model_path else ModelConfig(dtype=dtype))
    model = loaded.model
    native = model.model.native
    if native is None:
        raise SystemExit("the native step is not in use here (see the load log for why)")
    pin_threads()
    spec, block_size = model.kv_cache_spec, 16
    blocks = -(-context // block_size)
    shape = spec.layer_shape(batch * blocks, block_size)
    caches = [torch.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]
    table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    positions = torch.arange(context - query_len, context)  # [q]
    slots = table[:, positions // block_size].long() * block_size + positions % block_size
    md = AttentionMetadata(
        slot_mapping=slots.flatten(),
        block_table=table,
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * query_len,
        max_query_len=query_len,
        max_seq_len=context,
    )
    # distinct tokens: a mixture of experts routes each row as a real batch would
    ids = (torch.arange(batch * query_len) * 7919 + 5) % model.vocab_size
    positions = positions.repeat(batch)
    forward, head = [], []
    with torch.inference_mode():
        for _ in range(3):
            model.compute_logits(model(ids, positions, caches, md))
        native.stack.set_profiling(True)
        for _ in range(steps):
            start = time.perf_counter()
            hidden = model(ids, positions, caches, md)
            middle = time.perf_counter()
            model.compute_logits(hidden)
            forward.append(middle - start)
            head.append(time.perf_counter() - middle)
    stack_bytes = native.weight_bytes()
    head_bytes = int(model.lm_head.native.weight_bytes()) if model.lm_head.native else 0
    forward_ms = statistics.median(forward) * 1e3
    bandwidth = read_bandwidth_gb_s()
    return {
        "dtype": dtype,
        "quantization": loaded.quantization,
        "batch": batch,
        "query_len": query_len,
        "context": context,
        "forward_ms": round(forward_ms, 3),
        "lm_head_ms": round(statistics.median(head) * 1e3, 3),
        "parts_ms": {k: round(v / steps * 1e3, 3) for k, v in native.stack.profile().items()},
        "stack_weight_mb": round(stack_bytes / 1e6, 1),
        "stack_read_gb_s": round(stack_bytes / (forward_ms * 1e6), 1),
        "lm_head_weight_mb": round(head_bytes / 1e6, 1),
        "read_gb_s": round(bandwidth, 1),
        "streaming_limit_ms": round((stack_bytes + head_bytes) / (bandwidth * 1e6), 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a model path (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--query-len", type=int, default=1, help="tokens per sequence (k + 1 to verify k)"
    )
    args = parser.parse_args(argv)
    print(profile(args.dtype, args.batch, args.context, args.steps, args.query_len, args.model))


if __name__ == "__main__":
    main()
