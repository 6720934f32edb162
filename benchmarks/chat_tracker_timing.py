"""What reply parsing costs the chat endpoint per streamed token, without a server: the
scripted reply (scripted_chat.py) fed to ChatTracker.update one token per RequestOutput
delta, as the stream gets it, and each update's chunks serialised as the SSE stream does;
without parsers (tool_choice "none") and with the qwen3 reasoning parser and the hermes
tool parser, the passes alternating so drift hits both alike.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.scripted_chat import ScriptedChat

GENERATION_PROMPT = "<|im_start|>assistant\n"  # where Qwen3's template leaves the reply
VARIANTS = ("no_parsers", "parsers")


def _request(chat: ScriptedChat, parsed: bool):
    from services.frontend.openai.protocol import ChatCompletionRequest

    return ChatCompletionRequest(
        model="scripted",
        messages=chat.messages,
        tools=chat.openai_tools,
        tool_choice="auto" if parsed else "none",
        stream=True,
    )


def _tracker(chat: ScriptedChat, parsed: bool):
    """A fresh ChatTracker whose ReplyParser is built as the chat endpoint builds it."""
    from services.common.sampling_params import SamplingParams
    from services.frontend.openai.serving_base import Job, Prompt
    from services.frontend.openai.serving_chat import ChatTracker
    from services.frontend.openai.tool_choice import plan_tools
    from services.frontend.reasoning import get_reasoning_parser
    from services.frontend.reply_parser import ReplyParser
    from services.frontend.tool_options import ToolServerOptions

    request = _request(chat, parsed)
    options = ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    plan = plan_tools(request, options)
    reasoning = get_reasoning_parser("qwen3") if parsed else None
    prompt = Prompt(GENERATION_PROMPT, [0])
    job = Job("chatcmpl-bench", "scripted", [prompt], [SamplingParams()], recorder=None)

    def new_reply() -> ReplyParser:
        return ReplyParser(
            reasoning.stream(prompt.text) if reasoning is not None else None,
            plan.parser.stream() if plan.parser is not None else None,
        )

    return ChatTracker(request, job, None, new_reply)


def token_outputs(chat: ScriptedChat) -> list:
    """The reply as the engine streams it: a RequestOutput delta per token."""
    from services.common.outputs import CompletionOutput, RequestOutput

    pieces = chat.pieces
    outputs = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        done = CompletionOutput(0, piece, [i], finish_reason="stop" if last else None)
        outputs.append(RequestOutput("chatcmpl-bench-0", None, [0], [done], finished=last))
    return outputs


def replay(chat: ScriptedChat, parsed: bool, outputs: list) -> tuple[float, object]:
    """(seconds, tracker) of one pass: every update and its chunks' JSON."""
    tracker = _tracker(chat, parsed)
    envelope = tracker.envelope
    start = time.perf_counter()
    for output in outputs:
        for choice in tracker.update(0, output):
            envelope.json([choice])
    return time.perf_counter() - start, tracker


def check_parse(chat: ScriptedChat, tracker) -> None:
    """The parsed pass split the reply as a client must see it (else the timing is moot)."""
    message = tracker.response().choices[0].message
    calls = message.tool_calls or []
    if message.reasoning_content != chat.thought or message.content != chat.content:
        raise AssertionError(f"the reply parsed wrongly: {message}")
    if [(c.function.name, c.function.arguments) for c in calls] != [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}')
    ]:
        raise AssertionError(f"the tool call parsed wrongly: {calls}")


def measure_update_cost(chat: ScriptedChat, passes: int) -> dict:
    """µs per token of each variant (the median pass), what parsing adds and its ratio."""
    outputs = token_outputs(chat)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for index in range(passes + 1):  # the first pass of each warms up
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            elapsed, tracker = replay(chat, variant == "parsers", outputs)
            if index:
                seconds[variant].append(elapsed)
            if variant == "parsers" and index == 0:
                check_parse(chat, tracker)
    per_token = {v: round(1e6 * statistics.median(s) / len(outputs), 2) for v, s in seconds.items()}
    ratios = [p / n for p, n in zip(seconds["parsers"], seconds["no_parsers"], strict=True)]
    return {
        "tokens_per_pass": len(outputs),
        "passes": passes,
        "us_per_token": per_token,
        "parsing_us_per_token": round(per_token["parsers"] - per_token["no_parsers"], 2),
        "ratio_parsers_vs_none": round(statistics.median(ratios), 3),
    }
