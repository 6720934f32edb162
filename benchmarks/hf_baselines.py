"""HF transformers baselines on the benchmark's prompt ids and output lengths, greedy.

``generate`` in static left-padded batches runs each batch to its longest request
(``min_new_tokens``), but only each request's own ``output_len`` counts as useful output; HF's
continuous-batching manager (``generate_batch``'s) takes one length per request, no EOS stop."""

from __future__ import annotations

import logging
import time

import torch

from benchmarks.results import RunResult
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)
CB_TIMEOUT_S = 3600


def run_hf_baselines(
    folder: str, requests: list[BenchRequest], dtype: str, batch_sizes, continuous: bool
) -> list[RunResult]:
    """A static batch run per size, then continuous batching where this transformers has it."""
    from transformers import AutoModelForCausalLM

    if not batch_sizes and not continuous:
        return []
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    pad_id = model.generation_config.pad_token_id or 0
    runs = [run_hf_static(model, requests, size, pad_id) for size in batch_sizes]
    if continuous and not hasattr(model, "continuous_batching_context_manager"):
        logger.warning("this transformers has no continuous batching; skipped")
    elif continuous:
        try:
            runs.append(run_hf_continuous(model, requests))
        except (RuntimeError, TimeoutError) as exc:
            logger.warning("HF continuous batching failed: %s", exc)
    return runs


def run_hf_static(model, requests: list[BenchRequest], batch_size: int, pad_id: int = 0):
    """HF ``generate`` over consecutive left-padded batches of ``batch_size``."""
    start, generated = time.perf_counter(), 0
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width, steps = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
        rows = [[pad_id] * (width - r.prompt_len) + list(r.prompt_token_ids) for r in batch]
        masks = [[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch]
        ids, mask = torch.tensor(rows), torch.tensor(masks)
        lengths = {"max_new_tokens": steps, "min_new_tokens": steps, "pad_token_id": pad_id}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **lengths)
        generated += (out.shape[1] - ids.shape[1]) * out.shape[0]
    elapsed = time.perf_counter() - start
    run = RunResult.of(
        f"HF generate, static batch {batch_size}",
        requests,
        elapsed,
        generated=generated,
        output_tokens=sum(r.output_len for r in requests),
        extra={"batch_size": batch_size},
    )
    logger.info("%s: %.1f output tok/s", run.name, run.output_tokens_per_s)
    return run


def run_hf_continuous(model, requests: list[BenchRequest]) -> RunResult:
    """HF's continuous-batching manager, built and warmed up before the clock starts."""
    from transformers import GenerationConfig

    longest = max(r.output_len for r in requests)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=longest, eos_token_id=-1, pad_token_id=0
    )
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level, results = cb_logger.level, {}
    cb_logger.setLevel(logging.CRITICAL)  # it logs an error when psutil is missing
    try:
        with model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=30
        ) as manager:
            start = time.perf_counter()
            for r in requests:
                manager.add_request(
                    r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1
                )
            while len(results) < len(requests):
                if time.perf_counter() > start + CB_TIMEOUT_S:
                    raise TimeoutError(
                        f"HF continuous batching finished {len(results)}/{len(requests)}"
                    )
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError(
                        "HF continuous batching stopped before finishing every request"
                    )
            elapsed = time.perf_counter() - start
    finally:
        cb_logger.setLevel(level)
    generated = sum(len(r.generated_tokens) for r in results.values())
    name, extra = "HF continuous batching (generate_batch)", {"completed": len(results)}
    return RunResult.of(name, requests, elapsed, generated=generated, extra=extra)
