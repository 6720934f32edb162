"""ScriptedChat: the reply-parsing benchmark's conversation and its tiny Qwen3-style model.

The model (tests/helpers/scripted_model.py) answers any prompt greedily with the same
reply, one piece per token: `<think>`, `thinking` words, `</think>`, `answer` words, then
a hermes tool call cut into pieces the way a tokenizer cuts JSON. It is served with
Qwen3's own chat template, so the prompt is the one a Qwen3 server renders (tools in its
system prompt) and the reply is what the qwen3 reasoning parser and the hermes tool
parser read. Every piece is a distinct string (a bigram model needs that): the words
carry their index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).parents[1] / "tests" / "helpers" / "templates" / "qwen3.jinja"
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "\n\n")  # single tokens, as in Qwen3
WORDS = ("the", "user", "asks", "about", "weather", "so", "I", "should", "check", "Paris")
TOOL_CALL = (  # the call, as a tokenizer would cut it
    "<tool_call>",
    '\n{"name": ',
    '"get_weather"',
    ', "arguments": {',
    '"city": ',
    '"Paris"',
    ', "unit": ',
    '"celsius"',
    "}}\n",
    "</tool_call>",
)
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
DESCRIPTION = "The current weather in a city."
QUESTION = "What is the weather in Paris? Think it over, then call the tool."


def _words(first: int, count: int) -> list[str]:
    return [f" {WORDS[i % len(WORDS)]}{i}" for i in range(first, first + count)]


@dataclass(frozen=True)
class ScriptedChat:
    thinking: int  # thinking words (one token each)
    answer: int  # answer words before the tool call

    def __post_init__(self) -> None:
        if self.thinking < 1 or self.answer < 1:
            raise ValueError("the reply needs at least one thinking and one answer word.")

    @property
    def pieces(self) -> list[str]:
        """The reply, one token a piece."""
        thought = ["<think>", "\nOkay,", *_words(0, self.thinking), ".\n", "</think>", "\n\n"]
        answer = [*_words(self.thinking, self.answer), ". Calling the tool:\n"]
        return [*thought, *answer, *TOOL_CALL]

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": QUESTION}]

    @property
    def openai_tools(self) -> list[dict]:
        function = {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}
        return [{"type": "function", "function": function}]

    @property
    def anthropic_tools(self) -> list[dict]:
        return [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}]

    @property
    def thought(self) -> str:
        """The thinking as the qwen3 parser gives it back."""
        return "Okay," + "".join(_words(0, self.thinking)) + "."

    @property
    def content(self) -> str:
        """The answer's content before the call, as the parsers give it back."""
        return "".join(_words(self.thinking, self.answer)).lstrip() + ". Calling the tool:\n"

    def build(self, folder: Path) -> Path:
        """The scripted model saved as an HF folder (a source checkout's tests/helpers)."""
        from tests.helpers.scripted_model import build_scripted_model

        template = TEMPLATE.read_text(encoding="utf-8")
        return build_scripted_model(
            folder, {None: self.pieces}, chat_template=template, extra_tokens=TEMPLATE_TOKENS
        )
