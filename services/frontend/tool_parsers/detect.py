"""Which --tool-call-parser a chat template calls for, from the markers its tool
instructions carry (used when the flag is absent; tool_options.py).

The checks run most specific first: Qwen3-Coder's template writes `<tool_call>` and
`<function=`, hermes-style ones (Qwen2.5 / Qwen3, Hermes, SmolLM3) only `<tool_call>`;
Llama's pythonic templates spell out `[func_name1(params_name1=...` while its JSON ones
ask for `{"name": ..., "parameters": ...}` after `<|python_tag|>`. Gemma 3's template
has no tool format of its own, so nothing is detected for it.
"""

from __future__ import annotations

_PYTHONIC = ("func_name1(", "params_name1=")
_LLAMA3_JSON = ("<|python_tag|>", '"parameters": dictionary of argument name')


def detect_tool_parser(chat_template: str | None) -> str | None:
    if not chat_template:
        return None
    template = chat_template
    if "<tool_call>" in template:
        return "qwen3_coder" if "<function=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "functools[" in template or ("<|tool|>" in template and "<|/tool|>" in template):
        return "phi4_mini_json"
    if any(marker in template for marker in _PYTHONIC):
        return "pythonic"
    if any(marker in template for marker in _LLAMA3_JSON):
        return "llama3_json"
    if "<|python_start|>" in template:
        return "pythonic"
    return None
