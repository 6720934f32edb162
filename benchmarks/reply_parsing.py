"""What parsing a reasoning model's replies costs the server: `pagestream bench reply_parsing`.

A scripted Qwen3-style model (scripted_chat.py: thinking, an answer, a hermes tool call)
served twice by `pagestream serve`, the same but for the parsing flags (no_parsers: tools
sent with tool_choice "none", so the prompts match; parsers: qwen3 reasoning and hermes
tool calls). Measured: the serve process's CPU time per streamed token under closed-loop
load (the engine core runs in its child), the first event and first text delta of
/v1/messages against /v1/chat/completions, and ChatTracker.update's cost per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.chat_tracker_timing import measure_update_cost
from benchmarks.load_clients import HttpClient, ServerProcess, send_all
from benchmarks.results import median, percentiles, rotated
from benchmarks.scripted_chat import TOOL_CALL, ScriptedChat
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

VARIANTS = ("no_parsers", "parsers")
PARSER_FLAGS = {
    "no_parsers": (),
    "parsers": (
        *("--reasoning-parser", "qwen3"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    ),
}
TOOL_CHOICE = {"no_parsers": "none", "parsers": "auto"}
CPUCLOCK_SCHED = 2  # a process CPU clock's id: ~pid << 3 | this (Linux, clock_getcpuclockid)
TARGET_RATIO = 1.05  # parsing may add at most 5% to the frontend's CPU per token


@dataclass(frozen=True)
class ReplyParsingProfile:
    name: str
    thinking: int  # thinking words of the reply (a token each)
    answer: int  # answer words before its tool call
    concurrencies: tuple[int, ...]
    requests_per_client: int  # requests each closed-loop client sends in a run
    rounds: int
    first_event_requests: int  # per API, sequential
    first_event_max_tokens: int
    micro_passes: int  # ChatTracker replays of the reply per variant


REPLY_PARSING_PROFILES = {
    "smoke": ReplyParsingProfile("smoke", 8, 8, (1, 2), 1, 1, 2, 4, 2),
    "quick": ReplyParsingProfile("quick", 300, 300, (1, 8), 4, 7, 30, 8, 30),
    "full": ReplyParsingProfile("full", 300, 300, (1, 8, 32), 4, 9, 60, 8, 60),
}


@dataclass(frozen=True)
class ReplyParsingOptions:
    profile: ReplyParsingProfile
    engine_flags: tuple[str, ...] = ("--kv-cache-memory", "64MiB", "--dtype", "float32")

    def __post_init__(self) -> None:
        p = self.profile
        sizes = (p.requests_per_client, p.rounds, p.first_event_requests, p.micro_passes)
        if min(sizes) < 1 or min(p.concurrencies, default=0) < 1:
            raise ValueError("every count and concurrency of the profile must be at least 1.")


def _has_tokens(choice) -> bool:
    delta = choice.delta
    thinking = (delta.model_extra or {}).get("reasoning_content")
    return bool(delta.content or delta.tool_calls or thinking)


class ChatStreamClient(HttpClient):
    """The benchmarks' HTTP client (the official `openai` one) streaming the scripted
    conversation over /v1/chat/completions, greedy to the model's own end (EOS)."""

    name = "HTTP chat"

    def __init__(self, base_url: str, chat: ScriptedChat, tool_choice: str, **kwargs) -> None:
        super().__init__(base_url, **kwargs)
        self.chat, self.tool_choice = chat, tool_choice

    async def send(self, request: BenchRequest, cancel_after: int = 0, **params):
        return await super().send(request, cancel_after, **{"ignore_eos": False, **params})

    async def _stream(self, request: BenchRequest, params: dict):
        stream = await self.client.chat.completions.create(
            model=self.model,
            messages=self.chat.messages,
            tools=self.chat.openai_tools,
            tool_choice=self.tool_choice,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": params.pop("ignore_eos")},
            **params,
        )
        async for chunk in stream:
            usage = chunk.usage and chunk.usage.completion_tokens
            yield any(map(_has_tokens, chunk.choices)), usage


def cpu_seconds(pids) -> float:
    """user + system CPU seconds of whole processes (exited threads included) to the
    nanosecond, from Linux's per-process CPU clocks: /proc's figures step by 10 ms, more
    than a run's share of a token's microseconds can stand."""
    return sum(time.clock_gettime(((~pid) << 3) | CPUCLOCK_SCHED) for pid in pids)


def timed_run(
    server: ServerProcess,
    chat: ScriptedChat,
    variant: str,
    concurrency: int,
    count: int,
    reply_tokens: int,
) -> dict:
    """`count` requests from `concurrency` closed-loop clients; the serve process's CPU
    time per streamed token (and its engine core's, for scale)."""
    import psutil

    frontend = [server.process.pid]
    engine_core = [p.pid for p in psutil.Process(frontend[0]).children(recursive=True)]
    requests = [BenchRequest([], reply_tokens)] * count

    async def load():
        async with ChatStreamClient(server.url, chat, TOOL_CHOICE[variant]) as client:
            before = cpu_seconds(frontend), cpu_seconds(engine_core)
            records, duration = await send_all(client, requests, concurrency)
            after = cpu_seconds(frontend), cpu_seconds(engine_core)
        return records, duration, before, after

    records, duration, before, after = asyncio.run(load())
    ok = [r for r in records if r.ok]
    tokens = max(sum(r.output_tokens for r in ok), 1)
    per_token = [round(1e6 * (a - b) / tokens, 1) for a, b in zip(after, before, strict=True)]
    return {
        "variant": variant,
        "concurrency": concurrency,
        "requests": count,
        "failures": len(records) - len(ok),
        "failure_examples": [r.error or f"{r.output_tokens} tokens" for r in records if not r.ok],
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": round(tokens / duration, 1),
        "frontend_us_per_token": per_token[0],
        "engine_core_us_per_token": per_token[1],
    }


def served_summary(runs: list[dict], concurrencies) -> dict:
    """Per concurrency: each variant's medians over the rounds, and parsers / no_parsers
    as the median of each round's ratio (the rounds pair the two back to back)."""
    summary = {}
    for concurrency in concurrencies:
        mine = [r for r in runs if r["concurrency"] == concurrency]
        by = {v: [r for r in mine if r["variant"] == v] for v in VARIANTS}
        row = {}
        for variant, found in by.items():
            for key in ("frontend_us_per_token", "engine_core_us_per_token", "output_tokens_per_s"):
                row[f"{variant}.{key}"] = median(r[key] for r in found)
        pairs = zip(by["parsers"], by["no_parsers"], strict=True)
        ratios = [p["frontend_us_per_token"] / n["frontend_us_per_token"] for p, n in pairs]
        row["frontend_cpu_ratio"] = median(ratios)
        row["frontend_cpu_ratio_per_round"] = [round(r, 3) for r in ratios]
        row["target_met"] = row["frontend_cpu_ratio"] <= TARGET_RATIO
        summary[str(concurrency)] = row
    return summary


async def _first_openai(client, model: str, chat: ScriptedChat, max_tokens: int) -> tuple:
    """(s to the first chunk, s to the first chunk with text) of a streamed chat reply."""
    start, first, text = time.perf_counter(), None, None
    stream = await client.chat.completions.create(
        model=model,
        messages=chat.messages,
        tools=chat.openai_tools,
        tool_choice="auto",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    async for chunk in stream:
        now = time.perf_counter()
        first = first or now
        if text is None and any(map(_has_tokens, chunk.choices)):
            text = now
    return first - start, text - start


async def _first_anthropic(client, model: str, chat: ScriptedChat, max_tokens: int) -> tuple:
    """(s to the first event, s to the first content_block_delta) of a streamed message."""
    start, first, text = time.perf_counter(), None, None
    stream = await client.messages.create(
        model=model,
        messages=chat.messages,
        tools=chat.anthropic_tools,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"temperature": 0},
    )
    async for event in stream:
        now = time.perf_counter()
        first = first or now
        if text is None and event.type == "content_block_delta":
            text = now
    return first - start, text - start


def first_events(server: ServerProcess, chat: ScriptedChat, count: int, max_tokens: int) -> dict:
    """Sequential streamed requests, the two APIs alternating (after a warm-up of each):
    ms to the first event and to the first text (thinking or answer) delta."""
    from anthropic import AsyncAnthropic

    async def run() -> dict:
        times: dict[str, list[tuple]] = {"openai_chat": [], "anthropic_messages": []}
        async with HttpClient(server.url) as openai_client:
            anthropic = AsyncAnthropic(base_url=server.url, api_key="bench", max_retries=0)
            calls = {
                "openai_chat": lambda: _first_openai(
                    openai_client.client, openai_client.model, chat, max_tokens
                ),
                "anthropic_messages": lambda: _first_anthropic(
                    anthropic, openai_client.model, chat, max_tokens
                ),
            }
            for call in calls.values():
                await call()  # first-request costs
            for index in range(count):
                for api in rotated(list(calls), index):
                    times[api].append(await calls[api]())
            await anthropic.close()
        return times

    times = asyncio.run(run())
    found = {
        api: {
            "first_event_ms": percentiles((t[0] for t in pairs), (50, 90), scale=1e3, digits=2),
            "first_delta_ms": percentiles((t[1] for t in pairs), (50, 90), scale=1e3, digits=2),
        }
        for api, pairs in times.items()
    }
    medians = {api: statistics.median(t[0] for t in pairs) for api, pairs in times.items()}
    found["requests_per_api"] = count
    found["first_event_ratio"] = round(medians["anthropic_messages"] / medians["openai_chat"], 3)
    return found


def run_served(options: ReplyParsingOptions, folder: Path, chat: ScriptedChat) -> dict:
    """Both servers up side by side; every round runs each concurrency on both, in an
    order rotated each round; the first events on the parsing server at the end."""
    profile, reply_tokens = options.profile, len(chat.pieces) + 1  # + the EOS
    flags = (*options.engine_flags, "--max-num-seqs", str(max(profile.concurrencies)))
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = {
            v: stack.enter_context(
                ServerProcess(str(folder), engine_flags=(*flags, *PARSER_FLAGS[v]))
            )
            for v in VARIANTS
        }
        for variant, server in servers.items():  # first-request costs
            timed_run(server, chat, variant, 1, 1, reply_tokens)
        for round_index in range(profile.rounds):
            for concurrency in profile.concurrencies:
                for variant in rotated(VARIANTS, round_index):
                    count = concurrency * profile.requests_per_client
                    run = timed_run(
                        servers[variant], chat, variant, concurrency, count, reply_tokens
                    )
                    runs.append({**run, "round": round_index})
                    logger.info("reply_parsing %s c=%d: %s", variant, concurrency, run)
        first = _first_events_or_error(servers["parsers"], chat, profile)
    return {
        "served": served_summary(runs, profile.concurrencies),
        "runs": runs,
        "first_event": first,
    }


def _first_events_or_error(server, chat: ScriptedChat, profile: ReplyParsingProfile) -> dict:
    """The first-event comparison, or why it could not run (the anthropic client missing,
    the server without /v1/messages): the CPU figures stand without it."""
    try:
        return first_events(
            server, chat, profile.first_event_requests, profile.first_event_max_tokens
        )
    except Exception as exc:  # reported in the results, not a lost run
        logger.warning("first events not measured: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_reply_parsing(options: ReplyParsingOptions) -> dict:
    """The tracker's cost per token, then the two servers; a JSON-ready dict."""
    profile = options.profile
    chat = ScriptedChat(profile.thinking, profile.answer)
    found = {
        "profile": {**asdict(profile), "concurrencies": list(profile.concurrencies)},
        "reply": {
            "tokens": len(chat.pieces),
            "thinking_words": chat.thinking,
            "answer_words": chat.answer,
            "tool_call_tokens": len(TOOL_CALL),
        },
        "tracker_update": measure_update_cost(chat, profile.micro_passes),
    }
    with tempfile.TemporaryDirectory(prefix="pagestream-reply-parsing-") as folder:
        found |= run_served(options, chat.build(Path(folder)), chat)
    return found
