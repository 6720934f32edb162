"""The disk tier as an OpenAI client sees it (issue 52): a completion served, the server
stopped, a new server on the same --kv-offload-dir reports the prompt's cached tokens in
usage, returns the same text, and counts the tokens read back in /metrics."""

from __future__ import annotations

from tests.helpers.openai_server import MODEL, running_server
from tests.helpers.tiny_models import random_tokens

PROMPT = [t % 200 + 3 for t in random_tokens(30, seed=7)]  # 7 full blocks of 4, 2 more
ENGINE = '{engine="0"}'


async def _complete(folder, root):
    """One greedy completion of PROMPT on a fresh server; (completion, /metrics samples)."""
    async with running_server(
        folder, dtype="float32", block_size=4, kv_offload_dir=str(root)
    ) as server:
        completion = await server.async_client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0
        )
        return completion, await server.wait_until_idle()


async def test_a_restarted_server_reports_the_prompt_as_cached(model_dir, tmp_path):
    folder = model_dir("llama")
    first, samples = await _complete(folder, tmp_path)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert samples[f"pagestream:kv_offload_hits_total{ENGINE}"] == 0
    again, samples = await _complete(folder, tmp_path)
    assert again.usage.prompt_tokens_details.cached_tokens == 28  # never the last token
    assert samples[f"pagestream:kv_offload_hits_total{ENGINE}"] == 28
    assert samples[f"pagestream:kv_offload_load_failures_total{ENGINE}"] == 0
    assert again.choices[0].text == first.choices[0].text
