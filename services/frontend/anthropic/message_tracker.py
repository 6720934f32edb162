"""MessageTracker: one Messages request's engine outputs as an Anthropic message.

Each delta output's text goes through the request's ReplyParser (thinking, answer, tool
calls: the same split the chat endpoint makes) into ContentBlocks; the tracker adds the
stop reason and the usage. A Messages request has one choice (n is always 1).

Usage follows Anthropic's meaning: input_tokens are the prompt tokens not read from the
prefix cache, cache_read_input_tokens those that were (their sum is the prompt), and
output_tokens every generated token, thinking included.
"""

from __future__ import annotations

from services.common.outputs import RequestOutput
from services.frontend.anthropic.content_blocks import ContentBlocks
from services.frontend.openai.serving_base import Job
from services.frontend.reply_parser import ReplyParser

__all__ = ["MessageTracker"]


class MessageTracker:
    def __init__(self, job: Job, parser: ReplyParser) -> None:
        self.job = job
        self.parser = parser
        self.blocks = ContentBlocks()
        self.num_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.engine_stop_reason: int | str | None = None

    def update(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        """Take one delta output; the content-block events it makes."""
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        events: list[dict] = []
        for o in output.outputs:
            if self.finish_reason is not None:
                continue  # a choice's last output was taken
            self.num_tokens += len(o.token_ids)
            finished = o.finish_reason is not None
            events += self.blocks.feed(self.parser.feed(o.text, final=finished))
            if finished:
                self.finish_reason, self.engine_stop_reason = o.finish_reason, o.stop_reason
                events += self.blocks.close()
        return events

    @property
    def stop_reason(self) -> str:
        """end_turn, max_tokens, stop_sequence or tool_use. A reply cut by max_tokens is
        max_tokens even after a call (the call may be cut short)."""
        if self.finish_reason == "length":
            return "max_tokens"
        if self.blocks.num_tool_uses:
            return "tool_use"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return "end_turn"

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that ended the reply (the engine reports a stop string as its
        stop_reason; a stop token id or EOS is an int or None)."""
        stop = self.engine_stop_reason
        if self.finish_reason == "stop" and isinstance(stop, str):
            return stop
        return None

    def usage(self) -> dict:
        num_prompt = len(self.job.prompts[0].token_ids)
        return {
            "input_tokens": num_prompt - self.cached_tokens,
            "output_tokens": self.num_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
        }

    def message(self, content: list[dict] | None = None, final: bool = True) -> dict:
        """The message: whole (the non-streamed reply), or as message_start sends it
        (`final` false: no content, no stop reason yet)."""
        return {
            "id": self.job.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.job.model,
            "content": self.blocks.content() if content is None else content,
            "stop_reason": self.stop_reason if final else None,
            "stop_sequence": self.stop_sequence if final else None,
            "usage": self.usage(),
        }

    def start_event(self) -> dict:
        return {"type": "message_start", "message": self.message(content=[], final=False)}

    def end_events(self) -> list[dict]:
        """message_delta (the stop reason, the final usage) and message_stop."""
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [
            {"type": "message_delta", "delta": delta, "usage": self.usage()},
            {"type": "message_stop"},
        ]
