"""`pagestream serve -tp 2` as a process, with its two worker ranks started by the engine
(`mp`) or, with --split-services, as child processes next to a scheduler and a frontend:
the official openai client and the gRPC API get the greedy outputs of tp = 1; then one rank
is SIGKILLed while streams are in flight, and every stream (HTTP and gRPC) ends with an
error that names the rank (no hang), every readiness probe (HTTP /ready, the
frontend's and the scheduler's gRPC health) says not-ready, and nothing hangs or outlives
the test.

One serve per mode for the whole module (a process group takes seconds on two cores): the
fault test breaks it, so it stays the last test that uses `served`. The last test starts its
own serve, to lose the engine under HTTP traffic alone."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest

from pagestream import LLM, SamplingParams
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.helpers.eventually import eventually
from tests.helpers.processes import (
    NOT_SERVING,
    POLL_S,
    START_TIMEOUT_S,
    cli,
    cmdline,
    descendants,
    free_port,
    gone,
    grpc_token_ids,
    health_status,
    kill_pids,
    stop,
    wait_serving,
    worker_ranks,
)
from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

try:  # recent openai clients ship httpx as "httpx2"
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

MODEL_NAME = "tiny-tp2"
ENGINE = {"dtype": "float32", "kv_cache_memory": "8MiB"}
TEXT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paged attention stores keys"}]
PROMPT_IDS = [5, 17, 33, 99, 250, 12, 8, 41]
MAX_TOKENS = 12
LONG_TOKENS = 3500  # a stream that lasts tens of seconds: it is in flight at the kill
TIMEOUT_S = 60
STREAMS_END_S = 120  # streams the kill ends (with an error, checked): only a hang reaches it
# Usually the killed rank 1; rank 0 may tell first (its collective broke with the peer).
RANK_LOST = re.compile(r"worker rank [01] at 127\.0\.0\.1:\d+")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny Llama (4 query / 2 KV heads) with a tokenizer and room for long streams."""
    folder = tmp_path_factory.mktemp("tp2-model")
    build_tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=4096).save_pretrained(
        folder
    )
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(model) -> dict:
    """Greedy outputs of the in-process engine at tp = 1, same dtype."""
    llm = LLM(str(model), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {
        "text": llm.generate(TEXT, params, use_tqdm=False)[0].outputs[0].text,
        "chat": llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text,
        "ids": llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids,
    }
    llm.engine.close()
    return outputs


# ---- the served process ----------------------------------------------------------------
@dataclass
class Served:
    mode: str
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path
    tree: list[int] = field(default_factory=list)  # every process below serve once ready

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
        )

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _serve_argv(model: Path, mode: str, http_port: int, grpc_port: int) -> list[str]:
    argv = cli("--log-level", "INFO", "serve", str(model), "-tp", "2")
    argv += ["--port", str(http_port), "--grpc-port", str(grpc_port)]
    argv += ["--served-model-name", MODEL_NAME]
    argv += ["--dtype", ENGINE["dtype"], "--kv-cache-memory", ENGINE["kv_cache_memory"]]
    return argv + (["--split-services"] if mode == "split" else [])


def _stop_served(served: Served) -> None:
    """SIGTERM serve; then every process it ever had below it must be gone."""
    stop([served.process], timeout_s=30)
    try:
        eventually(lambda: gone(served.tree), f"every process below serve ({served.mode}) gone")
    finally:
        kill_pids(served.tree)


@contextlib.contextmanager
def serving(model: Path, mode: str, folder: Path) -> Iterator[Served]:
    """`pagestream serve -tp 2` (mode "mp" or "split") until SERVING; stopped on exit."""
    http_port, grpc_port = free_port(), free_port()
    log = folder / f"serve-{mode}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            _serve_argv(model, mode, http_port, grpc_port), stdout=out, stderr=subprocess.STDOUT
        )
    served = Served(mode, process, http_port, grpc_port, log)
    try:
        wait_serving(served.grpc_address, [process])
        served.tree = descendants(process.pid)
        yield served
    finally:
        served.tree = sorted(set(served.tree) | set(descendants(process.pid)))
        print(f"--- serve ({mode}) log tail ---\n{served.log_tail()}")
        _stop_served(served)


@pytest.fixture(scope="module", params=["mp", "split"])
def served(request, model, tmp_path_factory):
    with serving(model, request.param, tmp_path_factory.mktemp("serve")) as served:
        yield served


def test_each_rank_is_its_own_worker_process(served):
    ranks = worker_ranks(served.process.pid)
    assert sorted(ranks) == [0, 1]
    if served.mode == "mp":  # the engine logs the pids of the ranks it started
        logged = re.search(r"mp: started 2 worker processes \[(\d+), (\d+)\]", served.log_tail(400))
        assert logged, served.log_tail()
        assert [int(pid) for pid in logged.groups()] == [ranks[0], ranks[1]]
    else:  # --split-services: workers, scheduler and frontend are children of serve
        roles = sorted(cmd for pid in descendants(served.process.pid) for cmd in _role(pid))
        assert roles == ["frontend", "scheduler", "worker", "worker"]


def _role(pid: int) -> list[str]:
    return [a for a in cmdline(pid) if a in ("worker", "scheduler", "frontend")][:1]


# ---- answers equal tp = 1 --------------------------------------------------------------
def test_openai_chat_equals_tp1(served, reference):
    with served.client() as client:
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert reply.choices[0].message.content == reference["chat"]
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_openai_streamed_completion_equals_tp1(served, reference):
    with served.client() as client:
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=TEXT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(chunks) == reference["text"]
    assert len(chunks) > 1  # it streamed


def test_grpc_equals_tp1(served, reference):
    assert grpc_token_ids(served.grpc_address, PROMPT_IDS, MAX_TOKENS) == reference["ids"]


# ---- a rank dies mid-stream (keep last: it breaks the served group) ----------------------
@dataclass
class Outcome:
    """How a stream ended: kind is "error" (with what), "finished", or "failed-oddly"."""

    name: str
    kind: str = "running"
    detail: str = ""
    chunks: int = 0
    code: grpc.StatusCode | str | None = None  # the gRPC status, or the HTTP error's type
    started: threading.Event = field(default_factory=threading.Event)

    def chunk(self) -> None:
        self.chunks += 1
        self.started.set()


def _openai_chat_stream(served: Served, outcome: Outcome) -> None:
    """The openai client raises APIError on the server's SSE error event."""
    with served.client() as client:
        try:
            stream = client.chat.completions.create(
                model=MODEL_NAME,
                messages=CHAT,
                max_tokens=LONG_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    outcome.chunk()
            outcome.kind = "finished"
        except openai.APIStatusError as exc:  # an error status before the stream began
            outcome.kind, outcome.detail = "error", f"HTTP {exc.status_code}: {exc.message}"
            outcome.code = "server_error" if exc.status_code >= 500 else "client_error"
        except openai.APIConnectionError as exc:  # the connection broke: no error event
            outcome.kind, outcome.detail = "failed-oddly", repr(exc)
        except openai.APIError as exc:  # the SSE error event
            outcome.kind, outcome.detail = "error", exc.message
            outcome.code = exc.body.get("type") if isinstance(exc.body, dict) else None


def _raw_completion_stream(served: Served, outcome: Outcome) -> None:
    """/v1/completions read as raw SSE: the stream must carry an error event."""
    body = {
        "model": MODEL_NAME,
        "prompt": TEXT,
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with (
            httpx.Client(base_url=served.base_url, timeout=TIMEOUT_S) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            if response.status_code != 200:
                response.read()
                outcome.kind, outcome.detail = "error", response.text
                outcome.code = response.json()["error"]["type"]
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    outcome.kind, outcome.detail = "error", event["error"]["message"]
                    outcome.code = event["error"]["type"]
                    return
                outcome.chunk()
        outcome.kind = "finished"
    except httpx.HTTPError as exc:
        outcome.kind, outcome.detail = "failed-oddly", repr(exc)


def _grpc_stream(served: Served, outcome: Outcome, calls: list) -> None:
    request = pb.GenerateRequest(
        text=TEXT,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(served.grpc_address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=TIMEOUT_S)
        calls.append(call)
        try:
            for _ in call:
                outcome.chunk()
            outcome.kind = "finished"
        except grpc.RpcError as exc:
            outcome.kind, outcome.detail = "error", f"{exc.code().name}: {exc.details()}"
            outcome.code = exc.code()


def _http_status(served: Served, path: str) -> int | None:
    """GET path's status code, or None when nothing answers."""
    try:
        return httpx.get(f"{served.base_url}{path}", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_killing_a_rank_mid_stream_fails_every_request_and_readiness(served):
    ranks = worker_ranks(served.process.pid)
    victim = ranks[1]
    outcomes = [Outcome("openai chat stream"), Outcome("raw SSE completion"), Outcome("gRPC")]
    calls: list = []
    pool = ThreadPoolExecutor(len(outcomes))
    try:
        futures = [
            pool.submit(_openai_chat_stream, served, outcomes[0]),
            pool.submit(_raw_completion_stream, served, outcomes[1]),
            pool.submit(_grpc_stream, served, outcomes[2], calls),
        ]
        for outcome in outcomes:
            assert outcome.started.wait(TIMEOUT_S), f"{outcome.name} never streamed"
        assert all(o.kind == "running" for o in outcomes), outcomes

        os.kill(victim, signal.SIGKILL)
        done, hung = wait(futures, timeout=STREAMS_END_S)
        assert not hung, f"still streaming {STREAMS_END_S}s after the kill: {outcomes}"
        for future in done:
            future.result()  # a bug in the stream readers themselves
        for outcome in outcomes:  # each names the rank that failed the group
            assert outcome.kind == "error", (outcome, served.log_tail())
            assert RANK_LOST.search(outcome.detail), outcome
        # The server's fault, not the request's: a 5xx-type error and gRPC UNAVAILABLE.
        assert [o.code for o in outcomes] == ["server_error"] * 2 + [grpc.StatusCode.UNAVAILABLE]
        _assert_not_ready(served)
        _assert_serves_again(served)
    finally:
        for call in calls:
            call.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _assert_not_ready(served: Served) -> None:
    """serve stays up and every readiness probe says not ready: HTTP /ready, the
    frontend's gRPC health (and, split, the scheduler's); new requests get 503. Liveness
    (/health) stays up: the engine comes back by itself (mp: the engine-core process,
    whose loop died with the group, exits and serve starts a new one with a fresh worker
    group; split: the supervisor restarts the worker group and the scheduler reconnects)."""
    eventually(lambda: _http_status(served, "/ready") == 503, "HTTP /ready 503", interval=POLL_S)
    grpc_health = functools.partial(health_status, served.grpc_address)
    eventually(lambda: grpc_health() == NOT_SERVING, "the frontend NOT_SERVING", interval=POLL_S)
    if served.mode == "split":
        scheduler_health = functools.partial(health_status, _scheduler_address(served))
        eventually(
            lambda: scheduler_health() == NOT_SERVING, "the scheduler NOT_SERVING", interval=POLL_S
        )
    with served.client() as client, pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2)
    assert refused.value.status_code == 503
    assert _http_status(served, "/health") == 200
    assert served.process.poll() is None


def _assert_serves_again(served: Served) -> None:
    """Without a restart of serve: ready again, with a new worker group that answers."""
    eventually(
        lambda: _http_status(served, "/ready") == 200,
        "HTTP /ready 200",
        timeout=START_TIMEOUT_S,
        interval=POLL_S,
    )
    assert len(worker_ranks(served.process.pid)) == 2
    with served.client() as client:
        reply = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def _scheduler_address(served: Served) -> str:
    for pid in descendants(served.process.pid):
        argv = cmdline(pid)
        if "scheduler" in argv:
            return f"127.0.0.1:{argv[argv.index('--port') + 1]}"
    raise AssertionError("no scheduler process below serve")


def test_an_engine_lost_under_http_traffic_alone_turns_grpc_health_not_serving(model, tmp_path):
    """No gRPC stream is there to notice: the frontend's gRPC health must follow the
    engine all the same (it once flipped only when a Generate stream ended)."""
    with serving(model, "mp", tmp_path) as served:
        with served.client() as client:  # the group's step streams are open
            client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2)
            os.kill(worker_ranks(served.process.pid)[1], signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as refused:  # no step can run
                client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2)
        assert refused.value.status_code == 503
        eventually(
            lambda: _http_status(served, "/ready") == 503, "HTTP /ready 503", interval=POLL_S
        )
        grpc_health = functools.partial(health_status, served.grpc_address)
        eventually(
            lambda: grpc_health() == NOT_SERVING, "the frontend NOT_SERVING", interval=POLL_S
        )
