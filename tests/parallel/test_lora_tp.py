"""LoRA adapters under tensor parallelism: LLM(tensor_parallel_size=2) over gloo (the mp
backend) gives the outputs of tp = 1 and of PEFT with three adapters (q/v at rank 4; every
linear at rank 16 with use_rslora, so column-parallel slices of qkv / gate_up and
row-parallel o / down, whose adds the all-reduce sums; the MLP at rank 16), mixed with the
base in the same steps, with chunked prefill and preemption; prefix hits only under the
same adapter; n > 1 sampling.

One worker group for the whole module (process groups take seconds to start)."""

from __future__ import annotations

import random

import pytest

from pagestream import LLM, LoRARequest, SamplingParams
from tests.helpers.peft_reference import ATTENTION, MLP, PeftReference, save_adapter
from tests.helpers.tiny_tokenizer import VOCAB

# 12 blocks of 4 tokens at tp = 2 (one KV head of 16 dims a rank, 2 layers, float32);
# 16-token steps: the prompts arrive in chunks.
ENGINE = dict(
    dtype="float32",
    enable_lora=True,
    max_loras=2,
    max_lora_rank=16,
    block_size=4,
    kv_cache_memory=12 * 1024,
    max_num_batched_tokens=16,
)


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def adapters(folder, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("tp-adapters")
    specs = {
        "qv": dict(seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "all": dict(seed=2, r=16, lora_alpha=8, target_modules=ATTENTION + MLP, use_rslora=True),
        "mlp": dict(seed=3, r=16, lora_alpha=24, target_modules=MLP),
    }
    return [
        LoRARequest(name, i, str(save_adapter(folder, root / name, **spec)))
        for i, (name, spec) in enumerate(specs.items(), start=1)
    ]


@pytest.fixture(scope="module")
def tp2(folder):
    llm = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def tp1(folder):
    # Same number of blocks as tp = 2 (each tp = 1 block holds both KV heads).
    return LLM(str(folder), **{**ENGINE, "kv_cache_memory": 24 * 1024})


@pytest.fixture(scope="module")
def peft(folder):
    return PeftReference(folder)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _run(llm, prompts, params, loras):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, loras)


def test_mixed_adapters_match_one_worker_and_peft(tp2, tp1, peft, adapters):
    qv, every, mlp = adapters
    prompts = _prompts(3, (22, 9, 25, 14, 20, 17, 24))
    loras = [every, qv, None, mlp, every, None, qv]
    params = SamplingParams(temperature=0, max_tokens=8)
    scheduler = tp2.engine.scheduler
    preemptions = scheduler.num_preemptions
    got = _run(tp2, prompts, params, loras)
    assert scheduler.num_preemptions > preemptions  # 12 blocks: it had to preempt
    assert scheduler.kv.num_free_blocks == tp2.engine.cache_info.num_device_blocks
    expected = _run(tp1, prompts, params, loras)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        path = None if lora is None else lora.lora_path
        reference = list(expected[i].outputs[0].token_ids)
        peft.assert_greedy(path, prompt, reference, 8, what=f"tp = 1, prompt {i}")
        ids = list(got[i].outputs[0].token_ids)
        peft.assert_greedy(path, prompt, ids, 8, what=f"tp = 2, prompt {i}")


def test_prefix_hits_stay_within_the_adapter(tp2, peft, adapters):
    """A prompt of five blocks under one adapter twice, then under another: only the
    second run reads cached blocks."""
    _, every, mlp = adapters
    prompt = _prompts(4, (20,))[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    runs = [(lora, _run(tp2, [prompt], params, lora)[0]) for lora in (every, every, mlp)]
    assert [out.num_cached_tokens for _, out in runs] == [0, 16, 0]
    for lora, out in runs:
        peft.assert_greedy(lora.lora_path, prompt, list(out.outputs[0].token_ids), 6)


def test_seeded_samples_under_adapters_match_one_worker(tp2, tp1, adapters):
    qv, every, _ = adapters
    prompts = _prompts(5, (10, 13))
    params = SamplingParams(n=3, temperature=0.9, seed=17, max_tokens=6, ignore_eos=True)
    got = _run(tp2, prompts, params, [every, qv])
    expected = _run(tp1, prompts, params, [every, qv])
    for g, e in zip(got, expected, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in e.outputs]
        assert len({tuple(o.token_ids) for o in g.outputs}) > 1  # really three samples
