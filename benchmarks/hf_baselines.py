"""What users would otherwise run: HF transformers ``generate`` in static padded batches, and
HF transformers' own continuous batching (``generate_batch``'s manager).

Both get exactly the benchmark's prompts (token ids) and per-request output lengths. A static
batch must run until its longest request is done, so it generates ``max(output_len)`` tokens for
every row (``min_new_tokens`` keeps EOS from ending it early); only each request's own
``output_len`` tokens count as useful output. The continuous-batching manager takes one
``max_new_tokens`` per request and ``eos_token_id=-1`` (never stop early), like ignore_eos.
"""

from __future__ import annotations

import logging
import time

import torch

from benchmarks.results import RunResult
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)


def load_hf_model(folder: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _padded_batch(requests: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask, [B, longest prompt]."""
    width = max(r.prompt_len for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, request in enumerate(requests):
        ids[row, width - request.prompt_len :] = torch.tensor(request.prompt_token_ids)
        mask[row, width - request.prompt_len :] = 1
    return ids, mask


def run_hf_static(model, requests: list[BenchRequest], batch_size: int, pad_id: int = 0):
    """HF ``generate`` over consecutive padded batches of ``batch_size`` (greedy)."""
    start, generated = time.perf_counter(), 0
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        ids, mask = _padded_batch(batch, pad_id)
        steps = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=pad_id,
            )
        generated += (out.shape[1] - ids.shape[1]) * out.shape[0]
    elapsed = time.perf_counter() - start
    return RunResult.of(
        f"HF generate, static batch {batch_size}",
        requests,
        elapsed,
        generated=generated,
        output_tokens=sum(r.output_len for r in requests),
        extra={"batch_size": batch_size},
    )


def hf_continuous_batching_available(model) -> bool:
    return hasattr(model, "continuous_batching_context_manager")


def run_hf_continuous(model, requests: list[BenchRequest], timeout_s: float = 3600) -> RunResult:
    """HF's continuous-batching manager (what ``generate_batch`` runs), one output length per
    request. The manager is built and warmed up before the clock starts."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.output_len for r in requests),
        eos_token_id=-1,
        pad_token_id=0,
    )
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level = cb_logger.level
    cb_logger.setLevel(logging.CRITICAL)  # it logs an error when psutil is missing
    try:
        with model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=30
        ) as manager:
            start = time.perf_counter()
            ids = [
                manager.add_request(
                    r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1
                )
                for r in requests
            ]
            results = _collect_cb(manager, len(ids), start + timeout_s)
            elapsed = time.perf_counter() - start
    finally:
        cb_logger.setLevel(level)
    generated = sum(len(r.generated_tokens) for r in results.values())
    return RunResult.of(
        "HF continuous batching (generate_batch)",
        requests,
        elapsed,
        generated=generated,
        extra={"completed": len(results)},
    )


def _collect_cb(manager, num_requests: int, deadline: float) -> dict:
    results: dict = {}
    while len(results) < num_requests:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"HF continuous batching finished {len(results)}/{num_requests}")
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("HF continuous batching stopped before finishing every request")
    return results
