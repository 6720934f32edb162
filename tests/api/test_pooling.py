"""The pooling runner (LLM(model, runner="pooling")): embeddings equal HF AutoModel's last
hidden state pooled the same way (LAST, MEAN, CLS) on tiny random models, whether the
prompt is chunked small, hits the prefix cache or shares a step with generation requests;
Matryoshka truncation, base-model and sentence-transformers checkpoints, and bad input
refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagestream import LLM, PoolingParams, SamplingParams
from tests.helpers.engine_steps import run_until_done
from tests.helpers.hf_pooling import cosine, hf_pooled, normalized

ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=8)
PROMPTS = [
    [5, 17, 33, 99, 250, 12, 8, 41, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35],
    [3, 4, 5],
    [200, 100, 50, 25, 12, 6, 3, 1, 2, 4, 8, 16, 32, 64, 128, 255, 7, 77],
]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _close(got, ref) -> None:
    """Float32 parity: cosine > 0.9999 and elementwise within 1e-4 of the reference."""
    got = np.asarray(got)
    assert got.shape == ref.shape
    assert cosine(got, ref) > 0.9999
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-3)


@pytest.fixture(scope="module")
def pooling_llm(model_dir):
    """name, pooling type -> an LLM (kept for the module; one at a time is alive)."""
    held: dict = {}

    def get(name: str, pooling_type: str, **extra) -> LLM:
        key = (name, pooling_type, tuple(sorted(extra.items())))
        if key not in held:
            for llm in held.values():
                llm.engine.close()
            held.clear()
            config = {"pooling_type": pooling_type}
            held[key] = LLM(
                str(model_dir(name)), runner="pooling", pooler_config=config, **ENGINE, **extra
            )
        return held[key]

    yield get
    for llm in held.values():
        llm.engine.close()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2"])  # gpt2: HF fallback
def test_encode_equals_hf_pooled_last_hidden_state(pooling_llm, model_dir, name, pooling_type):
    llm = pooling_llm(name, pooling_type)
    outputs = llm.encode(_ids(PROMPTS), use_tqdm=False)  # chunks of 8 tokens
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert isinstance(output.outputs.data, torch.Tensor)  # as vLLM's PoolingOutput
        _close(output.outputs.data, hf_pooled(model_dir(name), prompt, pooling_type))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embed_is_the_normalized_pooled_state(pooling_llm, model_dir, pooling_type):
    llm = pooling_llm("llama", pooling_type)
    outputs = llm.embed(_ids(PROMPTS), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ref = normalized(hf_pooled(model_dir("llama"), prompt, pooling_type))
        _close(output.outputs.embedding, ref)
        assert output.outputs.hidden_size == 64
    raw = llm.embed(_ids(PROMPTS[:1]), PoolingParams(normalize=False), use_tqdm=False)[0]
    _close(raw.outputs.embedding, hf_pooled(model_dir("llama"), PROMPTS[0], pooling_type))


def test_chunk_size_does_not_change_the_embedding(model_dir):
    whole = LLM(
        str(model_dir("llama")), runner="pooling", **{**ENGINE, "max_num_batched_tokens": 64}
    )
    try:
        one_step = [o.outputs.data for o in whole.encode(_ids(PROMPTS), use_tqdm=False)]
    finally:
        whole.engine.close()
    small = LLM(
        str(model_dir("llama")), runner="pooling", **{**ENGINE, "max_num_batched_tokens": 3}
    )
    try:
        chunked = [o.outputs.data for o in small.encode(_ids(PROMPTS), use_tqdm=False)]
    finally:
        small.engine.close()
    for a, b in zip(one_step, chunked, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_a_prefix_cache_hit_gives_the_same_embedding(pooling_llm, model_dir, pooling_type):
    llm = pooling_llm("llama", pooling_type)
    prompt = PROMPTS[0]  # 23 tokens: one full block of 16 to hit
    first = llm.encode(_ids([prompt]), use_tqdm=False)[0]
    second = llm.encode(_ids([prompt]), use_tqdm=False)[0]
    # LAST reads only the last position: the cached prefix is reused. MEAN reads every
    # position, so it never takes prefix hits (they would skip positions).
    assert (second.num_cached_tokens > 0) == (pooling_type == "LAST")
    ref = hf_pooled(model_dir("llama"), prompt, pooling_type)
    _close(first.outputs.data, ref)
    _close(second.outputs.data, ref)


def test_pooling_shares_steps_with_generation(pooling_llm, model_dir, hf_greedy, monkeypatch):
    llm = pooling_llm("llama", "MEAN")
    engine = llm.engine
    plans = []
    execute = engine.executor.execute
    monkeypatch.setattr(
        engine.executor, "execute", lambda plan: plans.append(plan) or execute(plan)
    )
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen = [engine.add_request(None, {"prompt_token_ids": p}, greedy) for p in PROMPTS[1:]]
    pooled = [
        engine.add_request(None, {"prompt_token_ids": p}, PoolingParams(task="encode"))
        for p in PROMPTS
    ]
    results = run_until_done(engine)
    gen_ids, pool_ids = {s.request_id for s in gen}, {s.request_id for s in pooled}
    mixed = [
        p
        for p in plans
        if gen_ids & set(p.num_scheduled_tokens) and pool_ids & set(p.num_scheduled_tokens)
    ]
    assert mixed, "no step ran pooling and generation requests together"
    for state, prompt in zip(gen, PROMPTS[1:], strict=True):
        assert results[state.request_id].outputs[0].token_ids == hf_greedy(
            model_dir("llama"), prompt, 12
        )
    for state, prompt in zip(pooled, PROMPTS, strict=True):
        _close(
            results[state.request_id].outputs.data, hf_pooled(model_dir("llama"), prompt, "MEAN")
        )


def test_a_base_model_checkpoint_pools_and_refuses_to_generate(tmp_path, model_dir):
    """A folder saved by AutoModel (architectures LlamaModel, no LM head): runner auto
    picks pooling; it embeds as HF does and refuses generation by name."""
    from transformers import AutoModelForCausalLM

    source = model_dir("llama")
    AutoModelForCausalLM.from_pretrained(source).model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            (tmp_path / name).write_bytes((source / name).read_bytes())
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaModel"]
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        assert llm.engine.info.runner == "pooling" and not llm.engine.info.capabilities.can_generate
        out = llm.embed(_ids(PROMPTS[:1]), use_tqdm=False)[0]
        _close(out.outputs.embedding, normalized(hf_pooled(tmp_path, PROMPTS[0], "LAST")))
        with pytest.raises(ValueError, match="no LM head"):
            llm.generate(_ids(PROMPTS[:1]), SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.engine.close()


def _sentence_transformers_folder(tmp_path, source, mode: str, normalize: bool):
    folder = tmp_path / "st"
    folder.mkdir()
    for item in source.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{mode}": True}))
    return folder


@pytest.mark.parametrize(
    ("mode", "pooling_type", "normalize"),
    [("mean_tokens", "MEAN", False), ("lasttoken", "LAST", True)],
)
def test_a_sentence_transformers_folder_sets_the_pooler(
    tmp_path, model_dir, mode, pooling_type, normalize
):
    folder = _sentence_transformers_folder(tmp_path, model_dir("llama"), mode, normalize)
    llm = LLM(str(folder), **ENGINE)  # runner auto: modules.json says pooling
    try:
        pooler = llm.engine.input_processor.pooler
        assert (pooler.pooling_type, pooler.normalize) == (pooling_type, normalize)
        out = llm.embed(_ids(PROMPTS[:1]), use_tqdm=False)[0]
        ref = hf_pooled(folder, PROMPTS[0], pooling_type)
        _close(out.outputs.embedding, normalized(ref) if normalize else ref)
    finally:
        llm.engine.close()


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path, model_dir):
    folder = tmp_path / "matryoshka"
    folder.mkdir()
    for item in model_dir("llama").iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]})
    )
    llm = LLM(str(folder), runner="pooling", **ENGINE)
    try:
        out = llm.embed(_ids(PROMPTS[:1]), dimensions=16, use_tqdm=False)[0]
        ref = hf_pooled(folder, PROMPTS[0], "LAST")[:16]
        _close(out.outputs.embedding, normalized(ref))
        with pytest.raises(ValueError, match="matryoshka_dimensions"):
            llm.embed(_ids(PROMPTS[:1]), dimensions=20, use_tqdm=False)
    finally:
        llm.engine.close()


def test_bad_pooling_input_is_refused_by_name(pooling_llm, model_dir):
    llm = pooling_llm("llama", "LAST")
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed(_ids(PROMPTS[:1]), dimensions=16, use_tqdm=False)  # not a Matryoshka model
    with pytest.raises(ValueError, match="empty"):
        llm.embed([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([{"prompt_token_ids": [5] * 100_000}], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(str(model_dir("llama")), runner="pooling", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="unknown field"):
        LLM(str(model_dir("llama")), runner="pooling", pooler_config={"pooling": "MEAN"})
    # the engine still serves
    assert llm.encode(_ids(PROMPTS[:1]), use_tqdm=False)[0].outputs.data.shape == (64,)


def test_a_generate_runner_refuses_embeddings(model_dir):
    llm = LLM(str(model_dir("llama")), kv_cache_memory="8MiB")
    try:
        assert llm.engine.info.runner == "generate"
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed(_ids(PROMPTS[:1]), use_tqdm=False)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_pooling_requests_keep_their_embedding(model_dir, hf_greedy, mode):
    """12 blocks of 4 tokens for generation requests that grow and MEAN pooling requests
    that arrive behind them: pooling requests are preempted mid-prompt (their partial sums
    dropped or swapped with their blocks) and still equal HF."""
    folder = model_dir("llama")
    llm = LLM(
        str(folder),
        runner="pooling",
        pooler_config={"pooling_type": "MEAN"},
        dtype="float32",
        block_size=4,
        kv_cache_memory=24576,  # 12 blocks of this model
        swap_space=0.01,
        preemption_mode=mode,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    try:
        assert llm.engine.cache_info.num_device_blocks == 12
        engine, scheduler = llm.engine, llm.engine.scheduler
        mid_prompt = []  # pooling requests preempted part-way through their prompt
        preempt = scheduler._preempt

        def record(victim, mode=None):
            if victim.is_pooling and 0 < victim.num_computed_tokens < victim.num_prompt_tokens:
                mid_prompt.append(victim.request_id)
            preempt(victim, mode)

        scheduler._preempt = record
        greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        gen_prompts = (PROMPTS[0][:12], PROMPTS[2][:12])  # each grows to 26 tokens: 7 blocks
        gen = [engine.add_request(None, {"prompt_token_ids": p}, greedy) for p in gen_prompts]
        pool_prompts = [PROMPTS[0][:17], PROMPTS[2][:16], PROMPTS[0][3:20]]
        pooled = [
            engine.add_request(None, {"prompt_token_ids": p}, PoolingParams(task="encode"))
            for p in pool_prompts
        ]
        results = run_until_done(engine)
        assert mid_prompt, "no pooling request was preempted part-way through its prompt"
        for state, prompt in zip(pooled, pool_prompts, strict=True):
            _close(results[state.request_id].outputs.data, hf_pooled(folder, prompt, "MEAN"))
        for state, prompt in zip(gen, gen_prompts, strict=True):
            assert results[state.request_id].outputs[0].token_ids == hf_greedy(folder, prompt, 14)
        assert scheduler.kv.num_free_blocks == 12
    finally:
        llm.engine.close()


def test_async_scheduling_keeps_the_embeddings(model_dir):
    """Two plans in flight: a pooling request's chunks still land in order and add up."""
    llm = LLM(
        str(model_dir("llama")),
        runner="pooling",
        pooler_config={"pooling_type": "MEAN"},
        async_scheduling=True,
        **ENGINE,
    )
    try:
        outputs = llm.encode(_ids(PROMPTS), use_tqdm=False)
    finally:
        llm.engine.close()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        _close(output.outputs.data, hf_pooled(model_dir("llama"), prompt, "MEAN"))


def test_truncate_prompt_tokens_keeps_the_last_tokens(pooling_llm, model_dir):
    llm = pooling_llm("llama", "MEAN")
    long = PROMPTS[0] * 20  # 460 tokens: over the tiny model's 256
    out = llm.encode(_ids([long]), PoolingParams(task="encode", truncate_prompt_tokens=10), False)
    assert out[0].prompt_token_ids == long[-10:]
    _close(out[0].outputs.data, hf_pooled(model_dir("llama"), long[-10:], "MEAN"))
    whole = llm.encode(_ids([long]), PoolingParams(task="encode", truncate_prompt_tokens=-1), False)
    assert len(whole[0].prompt_token_ids) == llm.engine.info.max_model_len
    embedded = llm.embed(_ids([long]), truncate_prompt_tokens=10, use_tqdm=False)[0]
    _close(
        embedded.outputs.embedding, normalized(hf_pooled(model_dir("llama"), long[-10:], "MEAN"))
    )
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)


def test_convert_embed_runs_the_pooling_runner(model_dir):
    llm = LLM(str(model_dir("llama")), convert="embed", **ENGINE)
    try:
        assert llm.engine.info.runner == "pooling"
        out = llm.embed(_ids(PROMPTS[:1]), use_tqdm=False)[0]
        _close(out.outputs.embedding, normalized(hf_pooled(model_dir("llama"), PROMPTS[0], "LAST")))
    finally:
        llm.engine.close()
    with pytest.raises(ValueError, match="--runner pooling"):
        LLM(str(model_dir("llama")), convert="embed", runner="generate")
