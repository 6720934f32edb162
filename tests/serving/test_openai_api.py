"""The OpenAI-compatible HTTP API, driven by the official `openai` client (sync and async)
and raw HTTP against a real uvicorn server over the in-process engine: completions and
chat, streaming and not, n > 1, logprobs, stops, usage, SSE framing, tokenizer routes,
and client disconnects that abort their requests."""

import asyncio
import json

import pytest

from pagestream import SamplingParams
from tests.helpers.openai_server import MODEL, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 8}
NO_EOS = {"ignore_eos": True}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Paged attention?"}]},
]


async def _engine_text(server, prompt, max_tokens=8) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = [out async for out in server.engine.generate(prompt, params)]
    return outputs[-1].outputs[0].text


async def test_models_list_the_served_names(server):
    models = await asyncio.to_thread(lambda: server.sync_client().models.list())
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "pagestream"
    card = await server.async_client().models.retrieve(MODEL)
    assert card.id == MODEL


async def test_greedy_completion_matches_the_engine_and_llm(server, llm):
    client = server.sync_client()
    response = await asyncio.to_thread(
        lambda: client.completions.create(model=MODEL, prompt=PROMPT, extra_body=NO_EOS, **GREEDY)
    )
    choice = response.choices[0]
    assert choice.text == await _engine_text(server, PROMPT)
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert choice.text == offline[0].outputs[0].text
    assert choice.finish_reason == "length" and response.object == "text_completion"
    assert response.model == MODEL and response.id.startswith("cmpl-")
    num_prompt = len(server.engine.tokenizer.encode(PROMPT))
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, 8)
    assert usage.total_tokens == num_prompt + 8
    assert usage.prompt_tokens_details.cached_tokens >= 0


async def test_several_prompts_with_n_index_choices_prompt_major(server):
    prompts = [[5, 17, 33, 99], [250, 12, 8, 41, 7]]
    response = await server.async_client().completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=4,
        temperature=1.0,
        echo=True,
        extra_body=NO_EOS,
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    tokenizer = server.engine.tokenizer
    for choice in response.choices:
        prompt_text = tokenizer.decode(prompts[choice.index // 2])
        assert choice.text.startswith(prompt_text)  # echo: the choice's own prompt first
        assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == 9
    assert response.usage.completion_tokens == 16


async def test_streamed_prompts_with_n_finish_every_choice_once(server):
    stream = await server.async_client().completions.create(
        model=MODEL,
        prompt=["one two", "three four five"],
        n=2,
        max_tokens=5,
        temperature=1.0,
        stream=True,
        extra_body=NO_EOS,
    )
    texts, finishes = {}, {}
    async for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert finishes == {i: ["length"] for i in range(4)}
    assert set(texts) == {0, 1, 2, 3}


async def test_repeated_prompt_reports_cached_tokens(server):
    prompt = list(range(40, 40 + 40))  # two and a half 16-token blocks
    client = server.async_client()
    first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 40
    assert again.usage.prompt_tokens_details.cached_tokens == 32


async def test_completion_logprobs_in_openai_format(server):
    response = await server.async_client().completions.create(
        model=MODEL, prompt=PROMPT, logprobs=3, extra_body=NO_EOS, **GREEDY
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 8
    checked = 0
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 3 and logprob <= 0  # greedy: the chosen token is the top 1
        if len(top) == 3:  # (fewer: two tokens decode to the same string, e.g. a byte)
            assert top[token] == pytest.approx(logprob) == pytest.approx(max(top.values()))
            checked += 1
    assert checked >= 4
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert all(
        b - a == len(t)
        for a, b, t in zip(offsets[:-1], offsets[1:], logprobs.tokens[:-1], strict=True)
    )


async def test_echo_with_logprobs_scores_the_prompt(server):
    response = await server.async_client().completions.create(
        model=MODEL, prompt=PROMPT, logprobs=1, echo=True, extra_body=NO_EOS, **GREEDY
    )
    choice = response.choices[0]
    num_prompt = len(server.engine.tokenizer.encode(PROMPT))
    assert choice.text.startswith(PROMPT)
    assert len(choice.logprobs.tokens) == num_prompt + 8
    assert choice.logprobs.token_logprobs[0] is None  # nothing scores the first token
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])


async def test_stop_strings_trim_and_report_the_stop(server):
    client = server.async_client()
    full = (
        await client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body=NO_EOS, **{**GREEDY, "max_tokens": 16}
        )
    ).choices[0]
    stop = full.text[3:5]
    assert len(full.text) > 5 and stop
    cut = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        stop=[stop, "never-there"],
        extra_body=NO_EOS,
        **{**GREEDY, "max_tokens": 16},
    )
    choice = cut.choices[0]
    assert choice.text == full.text[: full.text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


async def test_streamed_completion_equals_the_whole_one_with_usage(server):
    client = server.async_client()
    args = {"model": MODEL, "prompt": PROMPT, "extra_body": NO_EOS, **GREEDY}
    whole = await client.completions.create(**args)
    stream = await client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    *content, last = chunks
    assert len(content) >= 2 and all(len(c.choices) == 1 for c in content)
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason]
    assert finishes == ["length"] and content[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


async def test_chat_matches_llm_chat(server, llm):
    response = await asyncio.to_thread(
        lambda: server.sync_client().chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body=NO_EOS, **GREEDY
        )
    )
    offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == offline[0].outputs[0].text
    assert choice.finish_reason == "length" and response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(offline[0].prompt_token_ids)
    assert response.usage.completion_tokens == 8


async def test_chat_max_completion_tokens_and_logprobs(server):
    response = await server.async_client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    choice = response.choices[0]
    assert response.usage.completion_tokens == 5
    entries = choice.logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy


async def test_chat_stream_role_then_content_then_finish(server):
    stream = await asyncio.to_thread(
        lambda: server.sync_client().chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            n=2,
            temperature=1.0,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    chunks = await asyncio.to_thread(list, stream)
    *content, usage_chunk = chunks
    for index in (0, 1):
        mine = [c.choices[0] for c in content if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert all(c.delta.role is None for c in mine[1:])
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert mine[-1].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_the_last_text_comes_before_the_finish_reason(server, endpoint):
    """OpenAI streams the final text with finish_reason null, then an empty delta with the
    reason: a client that keeps text only while finish_reason is null gets all of it."""
    client = server.sync_client()
    if endpoint == "chat":
        args = {"messages": MESSAGES}
        create, whole_text = client.chat.completions.create, lambda r: r.choices[0].message.content
        text_of = lambda choice: choice.delta.content or ""  # noqa: E731
    else:
        args = {"prompt": PROMPT}
        create, whole_text = client.completions.create, lambda r: r.choices[0].text
        text_of = lambda choice: choice.text  # noqa: E731
    args |= {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "extra_body": NO_EOS}
    whole = await asyncio.to_thread(lambda: create(**args))
    chunks = await asyncio.to_thread(lambda: list(create(**args, stream=True)))
    choices = [c.choices[0] for c in chunks]
    kept = "".join(text_of(c) for c in choices if c.finish_reason is None)
    assert kept == whole_text(whole) and kept
    last = choices[-1]
    assert last.finish_reason == "length" and text_of(last) == ""
    assert [c.finish_reason for c in choices].count("length") == 1
    if endpoint == "chat":
        assert last.delta.model_dump(exclude_none=True) == {}
        assert whole.choices[0].message.tool_calls is None  # no tools: no tool_calls field


async def test_sse_framing_over_raw_http(server):
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, **GREEDY, **NO_EOS}
    async with server.raw() as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        chunk = json.loads(event.removeprefix("data: "))
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL
        assert set(chunk["choices"][0]) >= {"index", "text", "logprobs", "finish_reason"}


async def test_tokenize_detokenize_health_version(server):
    async with server.raw(api_key=None) as client:
        tokens = (await client.post("/tokenize", json={"prompt": PROMPT})).json()
        assert tokens["tokens"] == server.engine.tokenizer.encode(PROMPT)
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
        text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        assert text["prompt"].endswith(PROMPT)
        chat = (await client.post("/tokenize", json={"messages": MESSAGES})).json()
        assert chat["count"] > tokens["count"]
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/version")).json()["version"]


async def test_client_disconnect_mid_stream_aborts(server):
    before = await server.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 200, **NO_EOS}
    async with server.raw() as client, client.stream("POST", "/v1/completions", json=body) as r:
        events = 0
        async for line in r.aiter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    samples = await server.wait_until_idle()
    assert samples['pagestream:kv_cache_usage_perc{engine="0"}'] == 0
    assert samples['pagestream:num_requests_running{engine="0"}'] == 0
    assert not server.engine.engine.has_unfinished_requests()
    aborted = 'pagestream:request_success_total{finished_reason="abort"}'
    assert samples[aborted] == before[aborted] + 1
    generated = samples["pagestream:generation_tokens_total"]
    assert 3 <= generated - before["pagestream:generation_tokens_total"] < 200


async def test_client_disconnect_before_the_response_aborts(server):
    before = await server.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, **NO_EOS}
    frontend = server.engine.frontend
    await server.disconnect_while_running("/v1/completions", body)
    samples = await server.wait_until_idle()
    assert samples['pagestream:kv_cache_usage_perc{engine="0"}'] == 0
    assert frontend.num_live_requests() == 0
    assert not server.engine.engine.has_unfinished_requests()
    aborted = 'pagestream:request_success_total{finished_reason="abort"}'
    assert samples[aborted] == before[aborted] + 1
    generated = samples["pagestream:generation_tokens_total"]
    assert generated - before["pagestream:generation_tokens_total"] < 200


async def test_metrics_count_tokens_and_latencies(server):
    before = await server.metrics()
    await server.async_client().completions.create(
        model=MODEL, prompt=PROMPT, extra_body=NO_EOS, **GREEDY
    )
    after = await server.metrics()

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("pagestream:generation_tokens_total") == 8
    assert delta("pagestream:prompt_tokens_total") == len(server.engine.tokenizer.encode(PROMPT))
    assert delta('pagestream:request_success_total{finished_reason="length"}') == 1
    assert delta("pagestream:time_to_first_token_seconds_count") == 1
    assert delta("pagestream:e2e_request_latency_seconds_count") == 1
    assert delta("pagestream:inter_token_latency_seconds_count") >= 1
    assert after['pagestream:prefix_cache_queries_total{engine="0"}'] >= before.get(
        'pagestream:prefix_cache_queries_total{engine="0"}', 0
    )
    for name in ("kv_cache_usage_perc", "num_preemptions_total", "prefix_cache_hits_total"):
        assert f'pagestream:{name}{{engine="0"}}' in after
    assert delta("pagestream:request_queue_time_seconds_count") == 1
    assert not [name for name in after if "_created" in name]  # as vLLM: no timestamp series


async def test_stop_lets_open_streams_finish_then_closes_the_port(model_dir):
    async with running_server(model_dir("llama")) as other:
        body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 40, **NO_EOS}
        async with other.raw() as client, client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            stopping = asyncio.create_task(other.http.stop())
            rest = [line async for line in lines]
            await asyncio.wait_for(stopping, timeout=30)
        assert [line for line in rest if line][-1] == "data: [DONE]"  # it ran to the end
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", other.http.port)


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_zero_scores_the_prompt_only(server, stream):
    """lm-eval-harness style scoring: the prompt and its logprobs back, nothing generated."""
    client = server.async_client()
    kwargs = {"model": MODEL, "prompt": PROMPT, "logprobs": 1, "echo": True, "max_tokens": 0}
    num_prompt = len(server.engine.tokenizer.encode(PROMPT))
    if stream:
        chunks = [c async for c in await client.completions.create(**kwargs, stream=True)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens
        ]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        response = await client.completions.create(**kwargs)
        choice = response.choices[0]
        text, tokens, finish = choice.text, choice.logprobs.tokens, choice.finish_reason
        assert response.usage.completion_tokens == 0
        assert response.usage.prompt_tokens == num_prompt
        scored = await client.completions.create(
            model=MODEL, prompt=PROMPT, logprobs=1, echo=True, max_tokens=1, temperature=0
        )
        expected = scored.choices[0].logprobs.token_logprobs[:num_prompt]
        assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-5, nan_ok=True)
    assert text == PROMPT
    assert len(tokens) == num_prompt
    assert finish == "length"
