"""One streamed OpenAI request, timed: the time to its first token, its text and its usage
(cached prompt tokens included). Logprobs are asked for so that every token sends a chunk:
a random model's first token may be a partial character, whose text the server holds back,
and the first chunk with text would come late."""

from __future__ import annotations

import json
import logging
import time
import urllib.request

TIMEOUT_S = 3600.0  # a long prefill on 2 cores, or a model's load before it


def chat_body(model: str, content: str, max_tokens: int) -> dict:
    """A greedy chat of one user message, `max_tokens` tokens (ignore_eos)."""
    messages = [{"role": "user", "content": content}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "logprobs": True}


def completion_body(model: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """A greedy completion of token ids, `max_tokens` tokens (ignore_eos)."""
    return {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "logprobs": 1}


def timed_stream(url: str, body: dict, timeout_s: float = TIMEOUT_S) -> dict:
    """Stream `body` (a chat where it has messages, else a completion; greedy, ignore_eos)
    from the server at `url`: {ttft_s, seconds, text, prompt_tokens, completion_tokens,
    cached_tokens}. The openai client's errors on an HTTP error."""
    from openai import OpenAI

    for name in ("httpx", "httpx2"):  # one INFO line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    client = OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=timeout_s)
    options = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    api = client.chat.completions if "messages" in body else client.completions
    start = time.perf_counter()
    first, text, usage = None, [], None
    with client, api.create(**options) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                piece = choice.delta.content if "messages" in body else choice.text
                if first is None and (piece or choice.logprobs):
                    first = time.perf_counter()  # logprobs: a token whose text is held back
                text.append(piece or "")
            usage = chunk.usage or usage
    end = time.perf_counter()
    if first is None or usage is None:
        raise RuntimeError("the stream ended without a token or without its usage")
    details = usage.prompt_tokens_details
    return {
        "ttft_s": round(first - start, 3),
        "seconds": round(end - start, 3),
        "text": "".join(text),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
    }


def post_json(url: str, path: str, body: dict, timeout_s: float = TIMEOUT_S) -> dict:
    """POST `body`; the JSON reply (urllib's HTTPError on an HTTP error)."""
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def get_json(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=60) as response:
        return json.load(response)
