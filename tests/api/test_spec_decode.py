"""Speculative decoding through the offline LLM on the tiny llama: with either method the
outputs equal the plain engine's for seeded sampling with n > 1 (the noise is keyed by
seed and output position), structured outputs, stop strings and stop token ids, logprobs
and beam search; proposals stop at disable_by_batch_size; a draft model with another
vocabulary is refused at start, naming speculative_config.model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagestream import LLM, SamplingParams
from tests.helpers.spec_decode import (
    METHODS,
    assert_same_outputs,
    copy_heavy_prompts,
    spec_config,
    spec_stats,
)
from tests.helpers.structured_constraints import REGEX, SCHEMA
from tests.helpers.tiny_models import build_tiny_model

ARGS = {"kv_cache_memory": "8MiB", "block_size": 8}


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def plain(folder):
    return LLM(str(folder), **ARGS)


@pytest.fixture(scope="module", params=METHODS)
def speculative(request, folder):
    """(method, an engine speculating with it); one per method for the module."""
    llm = LLM(str(folder), speculative_config=spec_config(request.param, folder), **ARGS)
    return request.param, llm


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _both(plain, llm, prompts, params):
    """The plain and the speculative outputs, and the speculative engine's stats of this
    call alone (its counters are cumulative)."""
    before = spec_stats(llm)
    reference = plain.generate(prompts, params, use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    after = spec_stats(llm)
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return reference, outputs, drafted, accepted


def test_seeded_sampling_with_n_3_is_unchanged(plain, speculative):
    method, llm = speculative
    # prompts of whole blocks: each sequence's first output lands in a new block, which
    # (with a draft model's lookahead slots) the parent held before the fork
    prompts = copy_heavy_prompts(seed=11)
    prompts = _ids([prompts[i][:n] for i, n in ((0, 32), (1, 24), (3, 40), (6, 16))])
    # the tiny random model is flat: at 0.8 the n-gram's proposals are hardly ever the
    # sampled tokens, at 0.01 (still sampled, not greedy) they often are
    params = [
        SamplingParams(n=3, temperature=t, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i, t in enumerate([0.01, 0.01, 0.8, 0.8])
    ]
    reference, outputs, drafted, accepted = _both(plain, llm, prompts, params)
    assert_same_outputs(reference, outputs, None)
    assert all(len(r.outputs) == 3 for r in outputs)
    assert len({tuple(o.token_ids) for r in outputs[2:] for o in r.outputs}) == 6  # sampled
    assert drafted > 0 and accepted > 0, (method, drafted, accepted)
    scheduler = llm.engine.scheduler
    assert scheduler.kv.num_free_blocks == llm.engine.cache_info.num_device_blocks


def test_greedy_batch_with_both_outcomes(plain, speculative, folder):
    method, llm = speculative
    prompts = copy_heavy_prompts(seed=12)
    params = [SamplingParams(temperature=0, max_tokens=16 + i) for i in range(len(prompts))]
    reference, outputs, drafted, accepted = _both(plain, llm, _ids(prompts), params)
    assert_same_outputs(reference, outputs, folder, prompts)
    assert drafted > 0
    if method == "draft_model":
        assert accepted == drafted  # the target as its own draft
    else:
        assert 0 < accepted < drafted


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_structured_outputs_are_unchanged(plain, speculative, kind):
    """Greedy and seeded; proposals are cut to the prefix the grammar allows (a draft
    model proposes without the grammar: for the regex, hardly ever an allowed token)."""
    method, llm = speculative
    constraint = (
        {"json": SCHEMA, "disable_any_whitespace": True} if kind == "json" else {"regex": REGEX}
    )
    params = [
        SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint),
        *[
            SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=constraint)
            for s in range(5)
        ],
    ]
    prompts = ["The answer is", "Hello", "def main():", "{", "[1, 2", "naïve café"]
    reference, outputs, drafted, _ = _both(plain, llm, prompts, params)
    assert_same_outputs(reference, outputs, None)
    for out in outputs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (kind, text)
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
    if kind == "json":  # proposals the grammar allowed (at least a prefix) were verified
        assert drafted > 0, method


def test_stop_strings_and_stop_token_ids_inside_runs(plain, speculative, folder):
    """Stops taken from the plain outputs a few tokens in, so they land inside accepted
    runs: the same cut text, lengths and finish reasons, stop reasons included."""
    _, llm = speculative
    prompts = _ids(copy_heavy_prompts(seed=13)[:6])
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = plain.generate(prompts, free, use_tqdm=False)
    tokenizer = plain.get_tokenizer()
    params = []
    for i, out in enumerate(full):
        ids = out.outputs[0].token_ids
        if i % 2:
            params.append(free.clone(stop_token_ids=[ids[5 + i]]))
        else:
            stop = tokenizer.decode(ids[6 + i : 8 + i]).strip() or tokenizer.decode(ids[6:9])
            params.append(free.clone(stop=[stop]))
    reference, outputs, drafted, _ = _both(plain, llm, prompts, params)
    assert_same_outputs(reference, outputs, folder, [p["prompt_token_ids"] for p in prompts])
    for ref, out in zip(reference, outputs, strict=True):
        assert out.outputs[0].text == ref.outputs[0].text
        assert out.outputs[0].stop_reason == ref.outputs[0].stop_reason
        assert out.outputs[0].finish_reason == "stop"
        assert len(out.outputs[0].token_ids) < 30
    assert drafted > 0


def test_logprobs_are_unchanged(plain, speculative):
    _, llm = speculative
    prompts = _ids(copy_heavy_prompts(seed=14)[:4])
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    reference, outputs, drafted, _ = _both(plain, llm, prompts, params)
    assert_same_outputs(reference, outputs, None)
    assert drafted > 0
    for ref, out in zip(reference, outputs, strict=True):
        a, b = ref.outputs[0].logprobs, out.outputs[0].logprobs
        assert len(a) == len(b) == 16
        for pa, pb in zip(a, b, strict=True):
            assert set(pa) == set(pb)
            for token, entry in pa.items():
                assert pb[token].logprob == pytest.approx(entry.logprob, abs=1e-5)
                assert pb[token].rank == entry.rank


FEATURES = {
    "penalties": dict(
        temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3
    ),
    "seeded-penalties": dict(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.4),
    "min-tokens-over-eos": dict(temperature=0, min_tokens=10, logit_bias={2: 3.0}),
    "logit-bias": dict(temperature=0, logit_bias={7: 2.0, 9: 1.5}),
    "top-k-p-min-p": dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_sampling_features_are_unchanged(plain, speculative, feature):
    """Every verified row samples with the sequence's own parameters at its position:
    penalties over the tokens before it (proposals included), min_tokens by its output
    count, seeded noise by (seed, position)."""
    method, llm = speculative
    prompts = _ids(copy_heavy_prompts(seed=19))
    params = [
        SamplingParams(seed=i, max_tokens=20, **FEATURES[feature]) for i in range(len(prompts))
    ]
    reference, outputs, drafted, _ = _both(plain, llm, prompts, params)
    assert_same_outputs(reference, outputs, None)
    # (greedy with penalties avoids every earlier token: the n-gram finds no match)
    assert drafted > 0 or (method, feature) == ("ngram", "penalties")
    if feature == "min-tokens-over-eos":
        assert all(len(o.outputs[0].token_ids) >= 10 for o in outputs)
        assert any(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_prompt_logprobs_are_unchanged(plain, speculative):
    _, llm = speculative
    prompts = _ids(copy_heavy_prompts(seed=20)[:4])
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1)
    reference, outputs, drafted, _ = _both(plain, llm, prompts, params)
    assert_same_outputs(reference, outputs, None)
    assert drafted > 0
    for ref, out in zip(reference, outputs, strict=True):
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == len(ref.prompt_token_ids)
        for a, b in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True):
            assert set(a) == set(b)
            for token, entry in a.items():
                assert b[token].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_beam_search_is_unchanged(plain, speculative):
    """Beams make no proposals; with a draft model their sequences still keep lookahead
    slots, which a fork must not share."""
    _, llm = speculative
    prompts = _ids([p[:14] for p in copy_heavy_prompts(seed=15)[:3]])
    params = SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=10)
    reference = plain.generate(prompts, params, use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for ref, out in zip(reference, outputs, strict=True):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
        for a, b in zip(ref.outputs, out.outputs, strict=True):
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_async_scheduling_with_swap_preemption(plain, folder, method):
    """Two plans in flight, a cache tight enough to swap: greedy and seeded n = 2 outputs
    as the plain engine's (an n > 1 parent swapped before its fork once came back in a
    plan row of 0 tokens)."""
    kv = {"ngram": 24 * 2048, "draft_model": 24 * 4096}[method]  # 24 blocks of 4
    llm = LLM(
        str(folder),
        async_scheduling=True,
        preemption_mode="swap",
        block_size=4,
        kv_cache_memory=kv,
        swap_space=0.01,
        max_num_batched_tokens=32,
        speculative_config=spec_config(method, folder),
    )
    assert llm.engine.core.batch_queue.max_size == 2
    prompts = _ids(copy_heavy_prompts(seed=17) + copy_heavy_prompts(seed=18)[:4])
    greedy = [SamplingParams(temperature=0, max_tokens=16 + i % 5) for i in range(len(prompts))]
    seeded = [SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=16) for i in range(12)]
    for params in (greedy, seeded):
        reference, outputs, drafted, _ = _both(plain, llm, prompts, params)
        assert_same_outputs(reference, outputs, None)
        assert drafted > 0
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.kv.num_free_blocks == 24


def test_no_proposals_at_disable_by_batch_size(folder, plain):
    config = spec_config("ngram", folder, disable_by_batch_size=4)
    llm = LLM(str(folder), speculative_config=config, **ARGS)
    prompts = _ids([copy_heavy_prompts(seed=16)[0]] * 4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference, outputs, drafted, _ = _both(plain, llm, prompts, params)
    assert drafted == 0  # four sequences in every step
    assert_same_outputs(reference, outputs, None)
    _, _, drafted, _ = _both(plain, llm, prompts[:3], params)
    assert drafted > 0  # three: below the bound
    assert llm.engine.info.speculative_decoding == "ngram k=3"
    assert plain.engine.info.speculative_decoding == ""


def test_a_draft_model_with_another_vocabulary_is_refused(folder, tmp_path):
    draft = tmp_path / "draft"
    build_tiny_model("llama", vocab_size=256).save_pretrained(draft)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.model .*256.*512"):
        LLM(str(folder), speculative_config=config, **ARGS)
