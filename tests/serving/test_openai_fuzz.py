"""The HTTP server's own OpenAPI schema, fuzzed with schemathesis for a bounded number of
cases per operation: no 5xx answer, and the server still serves afterwards."""

import asyncio
import os

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.helpers.openai_server import MODEL, running_server

# More cases per operation for a longer local hunt: PAGESTREAM_FUZZ_EXAMPLES=200.
MAX_EXAMPLES = int(os.environ.get("PAGESTREAM_FUZZ_EXAMPLES", "20"))


def _check_operation(operation, base_url: str) -> int:
    """Fuzz one operation; returns how many cases it ran."""
    label = f"{operation.method.upper()} {operation.path}"
    calls = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def check(case):
        response = case.call(base_url=base_url, timeout=60)
        calls.append(response.status_code)
        assert response.status_code < 500, (label, response.status_code, response.text[:300])

    check()
    return len(calls)


def _fuzz(base_url: str, only: str | None = None) -> dict[str, int]:
    """Every operation (or only the one labelled `only`, e.g. "POST /v1/embeddings")."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    counts = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        if only is None or label == only:
            counts[label] = _check_operation(operation, base_url)
    return counts


async def test_openapi_schema_fuzz_never_gets_a_server_error(model_dir):
    async with running_server(model_dir("llama"), api_key=None, max_model_len=96) as server:
        counts = await asyncio.to_thread(_fuzz, server.http.url)
        assert {"POST /v1/completions", "POST /v1/chat/completions"} <= set(counts)
        assert all(n > 0 for n in counts.values()), counts
        reply = await server.async_client().completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=2
        )
        assert reply.choices[0].finish_reason in {"length", "stop"}


async def test_embeddings_fuzz_on_a_pooling_server(model_dir):
    """/v1/embeddings where it serves (a generate server answers it 400 above)."""
    engine = {"runner": "pooling", "max_model_len": 96}
    async with running_server(model_dir("llama"), api_key=None, **engine) as server:
        counts = await asyncio.to_thread(_fuzz, server.http.url, "POST /v1/embeddings")
        assert list(counts) == ["POST /v1/embeddings"] and counts["POST /v1/embeddings"] > 0
        reply = await server.async_client().embeddings.create(model=MODEL, input=[5, 6, 7])
        assert len(reply.data[0].embedding) == 64
