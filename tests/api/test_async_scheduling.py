"""Async scheduling (two plans in flight on one worker) gives the same outputs as the
synchronous loop on a real tiny model: greedy across chunked prefill, prefix hits and both
preemption modes; seeded n > 1 sampling and beam search too (float32)."""

import random

import pytest

from pagestream import LLM, BeamSearchParams, SamplingParams


class _InFlightWatch:
    """Wraps the engine core's executor; records the most plans ever in flight at once."""

    def __init__(self, core) -> None:
        self.core = core
        self.inner = core.executor
        self.max_concurrent_batches = self.inner.max_concurrent_batches
        self.max_in_flight = 0

    def execute(self, plan):
        self.max_in_flight = max(self.max_in_flight, len(self.core.batch_queue) + 1)
        return self.inner.execute(plan)

    def close(self) -> None:
        self.inner.close()


def _llm(folder, async_scheduling: bool, **kwargs) -> tuple[LLM, _InFlightWatch]:
    llm = LLM(str(folder), dtype="float32", async_scheduling=async_scheduling, **kwargs)
    core = llm.engine.core
    assert core.batch_queue.max_size == (2 if async_scheduling else 1)
    watch = _InFlightWatch(core)
    core.executor = watch
    return llm, watch


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Mixed lengths; a third share one long prefix, a third another, the rest are fresh."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 23)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
        prompts.append(shared[i % 3] + tail if i % 3 < 2 else tail + [7] * (i % 5))
    return prompts


def _greedy(llm, prompts, max_tokens):
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens + i % 4) for i in range(len(prompts))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_chunked_prefill_and_prefix_hits(model_dir):
    folder = model_dir("llama")
    prompts = _prompts(33, seed=1)
    kwargs = {"kv_cache_memory": "16MiB", "max_num_batched_tokens": 48, "block_size": 16}
    results = {}
    for flag in (False, True):
        llm, watch = _llm(folder, flag, **kwargs)
        results[flag] = _greedy(llm, prompts, max_tokens=10)
        assert llm.engine.scheduler.get_stats().prefix_cache_hits > 0
        assert llm.engine.scheduler.kv.usage == 0.0
        assert watch.max_in_flight == (2 if flag else 1)
    assert results[True] == results[False]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_both_modes(model_dir, mode):
    folder = model_dir("llama")
    prompts = [p[:20] for p in _prompts(12, seed=2)]
    kwargs = {
        "block_size": 4,
        "kv_cache_memory": 24576,  # 12 blocks of this model: preemption is certain
        "swap_space": 0.01,
        "preemption_mode": mode,
        "max_num_batched_tokens": 16,  # chunked: the two plans in flight are half batches
        "enable_prefix_caching": False,
    }
    results = {}
    for flag in (False, True):
        llm, watch = _llm(folder, flag, **kwargs)
        scheduler = llm.engine.scheduler
        assert llm.engine.cache_info.num_device_blocks == 12
        results[flag] = _greedy(llm, prompts, max_tokens=12)
        assert scheduler.num_preemptions > 0
        assert scheduler.kv.num_free_blocks == 12 and not scheduler.in_flight.groups
        assert watch.max_in_flight == (2 if flag else 1)
    assert results[True] == results[False]


def test_seeded_parallel_sampling_and_beam_search(model_dir):
    folder = model_dir("llama")
    prompts = _prompts(6, seed=3)
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    results = {}
    for flag in (False, True):
        llm, _ = _llm(folder, flag, kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=32)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)
        searched = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:3]], beams)
        results[flag] = (
            [[o.token_ids for o in out.outputs] for out in outputs],
            [[o.token_ids for o in out.outputs] for out in searched],
        )
        assert llm.engine.scheduler.kv.usage == 0.0
    assert results[True] == results[False]
