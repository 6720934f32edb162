"""The machine's matmul ceiling at the model's linear shapes (FLOP-weighted median GFLOP/s of
one layer's projections and the LM head), and the FLOPs a workload needs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from benchmarks.workload import BenchRequest

NUM_TOKENS, MIN_TIME_S = 256, 0.3  # rows of x (a batch like the engine's); time per shape


@dataclass(frozen=True)
class ModelShapes:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShapes:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        sizes = (config.hidden_size, config.intermediate_size, config.num_hidden_layers)
        return cls(*sizes, heads, kv_heads, head_dim, config.vocab_size)

    @classmethod
    def of(cls, folder: str) -> ModelShapes:
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(folder).get_text_config())

    def kv_bytes_per_token(self, element_size: int = 4) -> int:
        """Keys and values of one token over every layer (float32 unless told)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def layer_linears(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of one decoder layer: fused QKV, O, gate/up, down."""
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        return [(h, qkv), (self.num_heads * d, h), (h, 2 * inter), (inter, h)]


@dataclass(frozen=True)
class Ceiling:
    gflops: float  # FLOP-weighted over the model's shapes
    per_shape: list[dict]  # {"shape": "MxKxN", "gflops": ...}
    num_tokens: int
    dtype: str
    threads: int


def measure_matmul_ceiling(shapes: ModelShapes, dtype: torch.dtype = torch.float32) -> Ceiling:
    """Median GFLOP/s of [NUM_TOKENS, in] @ [in, out] at each of the model's linear shapes."""
    linears = [(k, n, shapes.num_layers * k * n) for k, n in shapes.layer_linears()]
    linears.append((shapes.hidden_size, shapes.vocab_size, shapes.hidden_size * shapes.vocab_size))
    per_shape, seconds_per_flop = [], 0.0
    for k, n, weight in linears:
        rate = _time_matmul(NUM_TOKENS, k, n, dtype)
        per_shape.append({"shape": f"{NUM_TOKENS}x{k}x{n}", "gflops": round(rate, 1)})
        seconds_per_flop += weight / (rate * 1e9)
    gflops = sum(w for _, _, w in linears) / seconds_per_flop / 1e9
    dtype_name, threads = str(dtype).removeprefix("torch."), torch.get_num_threads()
    return Ceiling(gflops, per_shape, NUM_TOKENS, dtype_name, threads)


def _time_matmul(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """GFLOP/s of the faster of F.linear and oneDNN's linear on a weight packed once (what
    the engine runs, services/worker/layers/packed_weight.py): median of >= 5 timed calls."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    forms = [lambda: torch.nn.functional.linear(x, w)]
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is not None and torch.backends.mkldnn.is_available():
        packed = reorder(w)
        forms.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    best = 0.0
    with torch.inference_mode():
        for form in forms:
            form()  # warm up
            samples: list[float] = []
            start_all = time.perf_counter()
            while time.perf_counter() - start_all < MIN_TIME_S or len(samples) < 5:
                start = time.perf_counter()
                form()
                samples.append(time.perf_counter() - start)
            best = max(best, 2 * m * k * n / statistics.median(samples) / 1e9)
    return best


def workload_flops(shapes: ModelShapes, requests: list[BenchRequest]) -> dict[str, float]:
    """FLOPs a workload needs with a KV cache and no padding: {"linear", "attention", "total"}:
    the layers' projections for every token, the LM head for every output, QK^T and PV."""
    per_token = 2 * shapes.num_layers * sum(i * o for i, o in shapes.layer_linears())
    lm_head = 2 * shapes.hidden_size * shapes.vocab_size
    per_key = 4 * shapes.num_layers * shapes.num_heads * shapes.head_dim
    linear = attention = 0.0
    for request in requests:
        num_tokens = request.prompt_len + request.output_len
        linear += num_tokens * per_token + request.output_len * lm_head
        # token at position p attends to p + 1 keys: sum over p of (p + 1)
        attention += per_key * num_tokens * (num_tokens + 1) / 2
    return {"linear": linear, "attention": attention, "total": linear + attention}
