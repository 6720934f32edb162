"""The vLLM-compatible offline API on a tiny model: stops, n > 1 on shared blocks, abort,
logprobs, chat and the CLI."""

import json

import pytest
import torch

from pagestream import LLM, SamplingParams
from pagestream.cli import main as cli_main

LLM_ARGS = {"kv_cache_memory": "8MiB", "max_num_batched_tokens": 64}  # tests/conftest.py's llm


def _greedy(llm, prompt_ids, **kwargs):
    params = SamplingParams(temperature=0, **kwargs)
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0]


PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]


def test_stop_token_ids_max_tokens_min_tokens_ignore_eos(llm):
    free = _greedy(llm, PROMPT, max_tokens=12, ignore_eos=True)
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    stopped = _greedy(llm, PROMPT, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)
    later = _greedy(
        llm, PROMPT, max_tokens=12, stop_token_ids=[stop_id], min_tokens=first + 2, ignore_eos=True
    )
    assert len(later.token_ids) > first + 1


def test_stop_strings_trim_text(llm):
    full = _greedy(llm, PROMPT, max_tokens=16, ignore_eos=True)
    text = full.text
    assert len(text) > 4
    stop = text[3:5]
    cut = _greedy(llm, PROMPT, max_tokens=16, ignore_eos=True, stop=[stop])
    assert cut.text == text[: text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = _greedy(
        llm, PROMPT, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert llm.engine.scheduler.kv.usage == 0.0  # the stop-string abort freed the blocks


def test_parallel_sampling_shares_blocks(llm):
    scheduler = llm.engine.scheduler
    prompt = list(range(3, 3 + 60))
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    peak = _peak_blocks(llm, [{"prompt_token_ids": prompt}], params)
    outputs = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outputs}) > 1  # different samples
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # same seed
    single = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    # The same work as four independent requests (first tokens differ: no shared prefix).
    distinct = [{"prompt_token_ids": [300 + i, *prompt[1:]]} for i in range(4)]
    separate = _peak_blocks(llm, distinct, single)
    assert peak < separate  # one prefill, shared prompt blocks
    assert scheduler.kv.usage == 0.0


def _peak_blocks(llm, prompts, params):
    engine = llm.engine
    kv = engine.scheduler.kv
    kv.reset_prefix_cache()
    for prompt in prompts:
        engine.add_request(None, prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    kv.reset_prefix_cache()
    return peak


def test_abort_frees_every_block(llm):
    engine = llm.engine
    states = [
        engine.add_request(
            None, {"prompt_token_ids": PROMPT * 4}, SamplingParams(max_tokens=200, ignore_eos=True)
        )
        for _ in range(3)
    ]
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv.usage > 0
    engine.abort_request([s.request_id for s in states])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs if o.finished} == {s.request_id for s in states}
    assert all(o.outputs[0].finish_reason == "abort" for o in outputs if o.finished)
    assert engine.scheduler.kv.usage == 0.0


def test_logprobs_match_log_softmax(llm, model_dir):
    from transformers import AutoModelForCausalLM

    out = _greedy(llm, PROMPT, max_tokens=3, logprobs=3, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    assert len(out.logprobs) == 3
    for position, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry[token_id].rank == 1  # greedy picks the top token
        assert entry[token_id].logprob == pytest.approx(ref[position, token_id].item(), abs=1e-4)
        top3 = ref[position].topk(3).indices.tolist()
        assert set(top3) <= set(entry)
    total = sum(entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs, strict=True))
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_chat_uses_the_template(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello fox"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt == "<s>user: hello fox\n<s>assistant:"
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)


def test_chat_template_kwargs_reach_the_template(llm):
    template = "{{ messages[0]['content'] }}{% if greeting %} {{ greeting }}{% endif %}:"
    params = SamplingParams(temperature=0, max_tokens=1)
    messages = [{"role": "user", "content": "fox"}]
    out = llm.chat(
        messages, params, use_tqdm=False, chat_template=template,
        chat_template_kwargs={"greeting": "hi"},
    )[0]  # fmt: skip
    assert out.prompt == "fox hi:"
    assert llm.chat(messages, params, use_tqdm=False, chat_template=template)[0].prompt == "fox:"


def test_bad_input_is_a_clear_error_and_admits_nothing(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 5000}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids contains token id 99999"):
        llm.generate("x", SamplingParams(stop_token_ids=[99999]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias contains"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate("x", [SamplingParams(), SamplingParams()], use_tqdm=False)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv.usage == 0.0 and not engine.output_processor.states


def test_generate_command_writes_jsonl(model_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(
        json.dumps({"prompt_token_ids": PROMPT})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"prompt": "The fox", "sampling_params": {"max_tokens": 2}})
        + "\n"
    )
    target = tmp_path / "out.jsonl"
    args = ["generate", str(model_dir("llama")), "--input", str(source), "--output", str(target)]
    assert cli_main([*args, "--max-tokens", "5", "--ignore-eos", "--kv-cache-memory", "8MiB"]) == 0
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [len(r["outputs"][0]["token_ids"]) for r in rows] == [5, 5, 2]
    assert rows[1]["prompt"].startswith("<s>user: hi")


def test_prompt_logprobs_match_hf_across_chunks(model_dir):
    from transformers import AutoModelForCausalLM

    # A budget of 8 tokens splits the 20-token prompt into chunks.
    llm = LLM(str(model_dir("llama")), kv_cache_memory="8MiB", max_num_batched_tokens=8)
    prompt = [5, 17, 33, 99, 250, 12, 8, 41, 7, 7, 300, 301, 302, 303, 9, 10, 11, 12, 13, 14]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        token_id = prompt[position]
        expected = ref[position - 1, token_id].item()
        assert entry[token_id].logprob == pytest.approx(expected, abs=1e-4)
        assert set(ref[position - 1].topk(2).indices.tolist()) <= set(entry)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_survive_preemption(model_dir, mode):
    """Prompt logprobs under preemption (also mid-prompt) equal those of an unpressured run."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(22)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    items = [{"prompt_token_ids": p} for p in prompts]
    roomy = LLM(str(model_dir("llama")), kv_cache_memory="8MiB", block_size=4)
    expected = roomy.generate(items, params, use_tqdm=False)
    tight = LLM(
        str(model_dir("llama")),
        block_size=4,
        kv_cache_memory=24576,  # 12 blocks of 4 tokens for six 32-token sequences
        swap_space=0.01,
        preemption_mode=mode,
        max_num_batched_tokens=8,  # prompts arrive in chunks: preemption can hit mid-prompt
    )
    got = tight.generate(items, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for ours, ref in zip(got, expected, strict=True):
        assert len(ours.prompt_logprobs) == len(ref.prompt_logprobs) == 22
        assert ours.prompt_logprobs[0] is None
        for mine, theirs in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert mine.keys() == theirs.keys()
            for token_id, entry in mine.items():
                assert entry.logprob == pytest.approx(theirs[token_id].logprob, abs=1e-4)
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_kv_cache_smaller_than_max_model_len_caps_it_and_says_so(model_dir, caplog):
    """24 blocks of 4 hold 96 tokens: the engine serves max_model_len 96 (not the model's
    256), says so at start, and a 100-token prompt is refused naming it (not ended as
    "length" with no tokens)."""
    with caplog.at_level("WARNING", logger="services.scheduler.engine_core_builder"):
        llm = LLM(str(model_dir("llama")), kv_cache_memory=49152, block_size=4)
    assert llm.engine.cache_info.num_device_blocks == 24
    assert llm.engine.info.max_model_len == 96
    assert any("max_model_len is 96, not 256" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="max_model_len=96"):
        llm.generate({"prompt_token_ids": [5] * 100}, use_tqdm=False)
    (out,) = llm.generate(
        {"prompt_token_ids": [5] * 90},
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
