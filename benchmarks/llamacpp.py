"""llama.cpp on the workload (`pagestream bench throughput --llamacpp`): the same requests,
greedy, from F32 / BF16 GGUF exports, batched as llama.cpp's parallel decoding.

    runs, info = run_llamacpp_section(requests, LlamaCppOptions(model=...), check, runs)
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.results import RunResult, agreement, first_difference
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pagestream[bench]'"  # llama-cpp-python built from source
KV_TYPES = {"F32": 0, "BF16": 30}  # ggml_type of the KV cache per weight dtype
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
N_UBATCH, KV_UNIFIED = 512, False  # at most 512 tokens per ubatch; a KV stream per sequence
PAGESTREAM_FP32 = "pagestream LLM.generate (float32)"
PAGESTREAM_BF16 = "pagestream LLM.generate (bfloat16)"


@dataclass(frozen=True)
class LlamaCppOptions:
    model: str  # the model name or path (its GGUF file is the export's source)
    dtypes: tuple[str, ...] = ("F32",)
    seqs: tuple[int, ...] = (32,)  # n_seq_max values to run; the ratios use the fastest
    n_batch: int = 2048  # tokens per llama_decode
    # off: on the CPU, F32 runs faster without flash attention (BF16 is unaffected)
    flash_attn: str = "off"
    check_prompts: int = 4  # greedy agreement with pagestream float32: this many prompts
    check_tokens: int = 32  # of this many output tokens each

    def __post_init__(self) -> None:
        for name in ("n_batch", "check_prompts", "check_tokens", "seqs"):
            value = getattr(self, name)
            if min(value if name == "seqs" else [value], default=0) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        for name, allowed in (("flash_attn", FLASH_ATTN), ("dtypes", KV_TYPES)):
            value = getattr(self, name)
            if not set(value if name == "dtypes" else [value]) <= set(allowed):
                raise ValueError(f"{name} must be among {tuple(allowed)}, got {value!r}.")


def import_llama_cpp():
    try:
        import llama_cpp
        from llama_cpp._logger import set_verbose
    except ImportError as exc:
        raise RuntimeError(f"--llamacpp needs llama-cpp-python: {INSTALL_HINT}") from exc
    set_verbose(logger.isEnabledFor(logging.DEBUG))  # llama.cpp's own log: errors only
    return llama_cpp


def llama_cpp_version() -> str:
    return getattr(import_llama_cpp(), "__version__", "?")


@dataclass
class _Sequence:
    index: int  # the request's position in the workload
    request: BenchRequest
    num_fed: int = 0  # prompt tokens already in the KV cache
    output: list[int] = field(default_factory=list)


class LlamaCppEngine:
    """One llama.cpp model and context with room for n_seq_max sequences of max_len."""

    def __init__(self, gguf_path, dtype: str, options: LlamaCppOptions, max_len, n_seq_max):
        import torch

        self.lib = lib = import_llama_cpp()
        self.n_seq_max, self.n_batch, self.num_steps = n_seq_max, options.n_batch, 0
        self.n_threads = torch.get_num_threads()  # pagestream's
        lib.llama_backend_init()
        path, params = str(gguf_path).encode(), lib.llama_context_default_params()
        self.model = lib.llama_model_load_from_file(path, lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params.n_ctx = -(-max_len // 256) * 256 * n_seq_max  # a stream of max_len per seq
        self.n_ubatch = min(N_UBATCH, options.n_batch)
        params.n_batch, params.n_ubatch = options.n_batch, self.n_ubatch
        params.n_seq_max, params.kv_unified, params.no_perf = n_seq_max, KV_UNIFIED, True
        params.n_threads = params.n_threads_batch = self.n_threads
        params.type_k = params.type_v = KV_TYPES[dtype]
        params.flash_attn_type = FLASH_ATTN[options.flash_attn]
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {gguf_path}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(options.n_batch, 0, 1)

    def __enter__(self) -> LlamaCppEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def generate(self, requests: list[BenchRequest]) -> list[list[int]]:
        """Greedy output tokens of every request (exactly its output_len), continuous
        batching over n_seq_max slots in arrival order."""
        if self.n_seq_max > self.n_batch:  # every decoding sequence needs its row
            raise ValueError(f"n_seq_max {self.n_seq_max} > n_batch {self.n_batch}")
        waiting = collections.deque(enumerate(requests))
        free = list(range(self.n_seq_max - 1, -1, -1))
        running: dict[int, _Sequence] = {}
        outputs: list[list[int]] = [[] for _ in requests]
        while waiting or running:
            while waiting and free:
                running[free.pop()] = _Sequence(*waiting.popleft())
            rows = self._fill_batch(running)
            if (rc := self.lib.llama_decode(self.ctx, self.batch)) != 0:
                raise RuntimeError(f"llama_decode returned {rc} (n_ctx too small?)")
            self.num_steps += 1
            for row, slot in rows:
                seq = running[slot]
                logits = self.lib.llama_get_logits_ith(self.ctx, row)
                seq.output.append(int(np.ctypeslib.as_array(logits, (self.n_vocab,)).argmax()))
                if len(seq.output) == seq.request.output_len:
                    outputs[seq.index] = seq.output
                    self.lib.llama_memory_seq_rm(self.memory, slot, -1, -1)
                    del running[slot]
                    free.append(slot)
        return outputs

    def _fill_batch(self, running: dict[int, _Sequence]) -> list[tuple[int, int]]:
        """Decode tokens of every decoding sequence, then prompt chunks within n_batch;
        returns (batch row, slot) of the rows whose logits are read."""
        entries = []  # (token, position, slot, whether its logits are read) per batch row
        for slot, seq in running.items():
            if seq.num_fed == seq.request.prompt_len:
                position = seq.request.prompt_len + len(seq.output) - 1
                entries.append((seq.output[-1], position, slot, True))
        for slot, seq in running.items():  # a prompt's last token gives the first output
            ids, room = seq.request.prompt_token_ids, self.n_batch - len(entries)
            fed = range(seq.num_fed, seq.num_fed + max(0, min(len(ids) - seq.num_fed, room)))
            entries += [(ids[p], p, slot, p == len(ids) - 1) for p in fed]
            seq.num_fed += len(fed)
        batch = self.batch
        for row, (token, position, slot, logits) in enumerate(entries):
            batch.token[row], batch.pos[row], batch.logits[row] = token, position, logits
            batch.n_seq_id[row], batch.seq_id[row][0] = 1, slot
        batch.n_tokens = len(entries)
        return [(row, entry[2]) for row, entry in enumerate(entries) if entry[3]]

    def warm_up(self, request: BenchRequest) -> None:
        short = BenchRequest(list(request.prompt_token_ids[:16]), 4)
        self.generate([short, short])
        self.lib.llama_memory_clear(self.memory, True)


def run_llamacpp(
    requests: list[BenchRequest], gguf_path, dtype: str, n_seq_max: int, options: LlamaCppOptions
) -> tuple[RunResult, list[list[int]]]:
    """The workload through llama.cpp (timed after a warm-up; loading is not timed)."""
    max_len = max(r.prompt_len + r.output_len for r in requests)
    with LlamaCppEngine(gguf_path, dtype, options, max_len, n_seq_max) as engine:
        engine.warm_up(requests[0])
        engine.num_steps = 0
        load = os.getloadavg()[0]
        start = time.perf_counter()
        outputs = engine.generate(requests)
        elapsed = time.perf_counter() - start
    extra = {
        "gguf": str(gguf_path.name),
        "n_seq_max": n_seq_max,
        "n_threads": engine.n_threads,
        "n_batch": options.n_batch,
        "n_ubatch": engine.n_ubatch,
        "kv_unified": KV_UNIFIED,
        "kv_cache_dtype": dtype,
        "flash_attn": options.flash_attn,
        "num_steps": engine.num_steps,
        # the machine may be shared; llama.cpp's spinning threads suffer most from that
        "load_average": {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)},
        "llama_cpp_python": llama_cpp_version(),
    }
    name = f"llama.cpp {dtype} ({n_seq_max} seqs)"
    result = RunResult.of(name, requests, elapsed, generated=sum(map(len, outputs)), extra=extra)
    logger.info("%s: %.1f output tok/s", result.name, result.output_tokens_per_s)
    return result, outputs


def check_requests(requests: list[BenchRequest], options: LlamaCppOptions) -> list[BenchRequest]:
    """The agreement check's requests: the first prompts, check_tokens outputs each."""
    chosen = requests[: options.check_prompts]
    return [BenchRequest(r.prompt_token_ids, options.check_tokens) for r in chosen]


def check_agreement(got: list[list[int]], reference: list[list[int]]) -> dict:
    """The short check's agreement, with every request's first difference."""
    firsts = [first_difference(g, r) for g, r in zip(got, reference, strict=True)]
    tokens_each = len(reference[0]) if reference else 0
    return {**agreement(got, reference), "tokens_each": tokens_each, "first_differences": firsts}


def run_llamacpp_section(
    requests: list[BenchRequest],
    options: LlamaCppOptions,
    reference: list[list[int]] | None,
    pagestream_runs: list[RunResult] | None = None,
) -> tuple[list[RunResult], dict]:
    """Every dtype x sequence count; then each dtype's greedy agreement with `reference`
    (pagestream float32 on check_requests) and, over the whole workload, of each dtype's
    first run (and pagestream bfloat16's) with pagestream float32's kept tokens."""
    from benchmarks.gguf_export import export_gguf, source_gguf

    import_llama_cpp()
    source = source_gguf(options.model)
    paths = {dtype: export_gguf(source, dtype) for dtype in options.dtypes}
    runs, tokens = [], {}
    for dtype in options.dtypes:
        for n_seq_max in options.seqs:
            run, outputs = run_llamacpp(requests, paths[dtype], dtype, n_seq_max, options)
            runs.append(run)
            tokens.setdefault(dtype, (run.name, outputs))
    info: dict = {
        "llama_cpp_python": llama_cpp_version(),
        "source_gguf": source.name,
        "seqs": list(options.seqs),
        "n_batch": options.n_batch,
        "kv_unified": KV_UNIFIED,
        "flash_attn": options.flash_attn,
        "runs": [r.name for r in runs],
    }
    if reference is not None:
        checks = check_requests(requests, options)
        max_len = max(r.prompt_len + r.output_len for r in checks)
        info["agreement"] = {}
        for dtype, path in paths.items():
            with LlamaCppEngine(path, dtype, options, max_len, len(checks)) as engine:
                info["agreement"][dtype] = check_agreement(engine.generate(checks), reference)
            logger.info("llama.cpp %s vs pagestream float32: %s", dtype, info["agreement"][dtype])
    ours = {r.name: r.token_ids for r in pagestream_runs or [] if r.token_ids is not None}
    if PAGESTREAM_FP32 in ours:
        if PAGESTREAM_BF16 in ours:
            tokens["pagestream bfloat16"] = (PAGESTREAM_BF16, ours[PAGESTREAM_BF16])
        info["agreement_full"] = {
            key: {"run": name, **agreement(got, ours[PAGESTREAM_FP32])}
            for key, (name, got) in tokens.items()
        }
        logger.info("vs pagestream float32, whole workload: %s", info["agreement_full"])
    return runs, info
