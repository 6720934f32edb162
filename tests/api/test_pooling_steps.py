"""A pooling request step by step through the whole engine (LLM(runner="pooling"), tiny
random Llama, float32): a MEAN prompt chunked over several steps comes back once, in the
step that ends it, equal to the same prompt in one step and to HF's mean; one aborted
mid-prompt leaves no pooled state on the worker. Preemption mid-prompt is
tests/api/test_pooling.py's (against HF)."""

from __future__ import annotations

import numpy as np

from pagestream import LLM, PoolingParams
from tests.helpers.engine_steps import run_until_done
from tests.helpers.hf_pooling import cosine, hf_pooled

PROMPTS = [
    [5, 17, 33, 99, 250, 12, 8, 41, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35],
    [200, 100, 50, 25, 12, 6, 3, 1, 2, 4, 8, 16, 32, 64, 128, 255, 7, 77],
]
ENCODE = PoolingParams(task="encode")


def _mean_llm(folder, **engine) -> LLM:
    config = {"pooling_type": "MEAN"}
    return LLM(str(folder), runner="pooling", pooler_config=config, dtype="float32", **engine)


def _record_steps(engine) -> list:
    """(plan, future of its RunnerOutput) for every step the engine submits from now on."""
    steps = []
    execute = engine.executor.execute

    def record(plan):
        future = execute(plan)
        steps.append((plan, future))
        return future

    engine.executor.execute = record
    return steps


def _encode(engine, prompts) -> tuple[list[np.ndarray], list[str]]:
    """Each prompt's raw pooled vector, and its request id."""
    states = [engine.add_request(None, {"prompt_token_ids": p}, ENCODE) for p in prompts]
    results = run_until_done(engine)
    vectors = [np.asarray(results[s.request_id].outputs.data) for s in states]
    return vectors, [s.request_id for s in states]


def test_a_chunked_mean_prompt_equals_the_whole_prompt_and_hf(model_dir):
    folder = model_dir("llama")
    chunked_llm = _mean_llm(folder, kv_cache_memory="8MiB", max_num_batched_tokens=4)
    try:
        steps = _record_steps(chunked_llm.engine)
        chunked, request_ids = _encode(chunked_llm.engine, PROMPTS)
    finally:
        chunked_llm.engine.close()
    for rid in request_ids:
        ran = [plan for plan, _ in steps if rid in plan.num_scheduled_tokens]
        returned = [plan for plan, out in steps if rid in out.result().pooled]
        assert len(ran) >= 5  # 18 or 23 tokens, at most 4 a step
        assert returned == [ran[-1]]  # once, in the step that ends the prompt
    whole_llm = _mean_llm(folder, kv_cache_memory="8MiB", max_num_batched_tokens=64)
    try:
        whole, _ = _encode(whole_llm.engine, PROMPTS)
    finally:
        whole_llm.engine.close()
    for prompt, a, b in zip(PROMPTS, chunked, whole, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        ref = hf_pooled(folder, prompt, "MEAN")
        assert cosine(a, ref) > 0.9999
        np.testing.assert_allclose(a, ref, atol=1e-4, rtol=1e-3)


def test_a_pooling_request_aborted_mid_prompt_leaves_no_state_behind(model_dir):
    """Its partial sums go with it on the worker (its slot is dropped with the next plan,
    whichever request that plan runs): the same id again pools from scratch."""
    folder = model_dir("llama")
    llm = _mean_llm(folder, kv_cache_memory="8MiB", max_num_batched_tokens=4)
    try:
        engine = llm.engine
        engine.add_request("p", {"prompt_token_ids": PROMPTS[0]}, ENCODE)
        engine.step()
        engine.step()
        assert 0 < engine.scheduler.requests["p"].num_computed_tokens < len(PROMPTS[0])
        engine.abort_request(["p"])
        aborted = run_until_done(engine)["p"]
        assert aborted.outputs is None and "abort" in aborted.error
        assert "p" in engine.worker.runner.input_batch  # no plan has run since the abort
        engine.add_request("q", {"prompt_token_ids": PROMPTS[1]}, ENCODE)
        engine.step()  # the next plan carries the abort to the worker
        assert "p" not in engine.worker.runner.input_batch  # its slot and state are gone
        run_until_done(engine)
        again, _ = _encode_with_id(engine, "p", PROMPTS[0])
    finally:
        llm.engine.close()
    np.testing.assert_allclose(again, hf_pooled(folder, PROMPTS[0], "MEAN"), atol=1e-4, rtol=1e-3)


def _encode_with_id(engine, request_id: str, prompt) -> tuple[np.ndarray, str]:
    engine.add_request(request_id, {"prompt_token_ids": prompt}, ENCODE)
    return np.asarray(run_until_done(engine)[request_id].outputs.data), request_id
