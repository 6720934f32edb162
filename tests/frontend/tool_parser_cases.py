"""Shared by the tool-parser tests: valid replies in every native format with the calls
they must give, and helpers that feed a reply whole or in chunks."""

from __future__ import annotations

import random

from services.frontend.tool_parsers import assemble

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"$ref": "#/$defs/units"},
            "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
        },
        "required": ["city"],
        "$defs": {"units": {"enum": ["c", "f"]}},
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
TOOLS = [WEATHER, TIME]

CITY = 'Zürich "HB"\n🙂 \\ end'  # quotes, a newline, a backslash, non-ASCII
WEATHER_ARGS = (
    '{"city": "Zürich \\"HB\\"\\n🙂 \\\\ end", "days": 3, "units": "c", '
    '"options": {"hourly": true, "levels": [1, {"k": null}]}}'
)
EXPECTED = [("get_weather", WEATHER_ARGS), ("get_time", "{}")]

# One reply per format: some content (where the format allows it), then both calls.
REPLIES = {
    "hermes": (
        "Checking.\n",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"HB\\"\\n🙂 \\\\'
        ' end", "days": 3, "units": "c", "options": {"hourly": true, "levels": [1, {"k":'
        ' null}]}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
    ),
    "qwen3_coder": (
        "Checking.\n",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + CITY + "\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=units>\nc\n</parameter>\n"
        "<parameter=options>\n{'hourly': True, 'levels': [1, {'k': None}]}\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
        "</tool_call>",
    ),
    "mistral": (
        "Checking.\n",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich \\"HB\\"\\n🙂 \\\\ end", "days": 3,'
        ' "units": "c", "options": {"hourly": true, "levels": [1, {"k": null}]}}'
        "[TOOL_CALLS]get_time[ARGS]{}",
    ),
    "mistral_list": (
        "Checking.\n",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich \\"HB\\"\\n🙂'
        ' \\\\ end", "days": 3, "units": "c", "options": {"hourly": true, "levels": [1,'
        ' {"k": null}]}}}, {"name": "get_time", "arguments": {}}]',
    ),
    "pythonic": (
        "",
        '[get_weather(city="Zürich \\"HB\\"\\n🙂 \\\\ end", days=3, units=\'c\', '
        "options={'hourly': True, 'levels': [1, {'k': None}]}), get_time()]",
    ),
    "llama4_pythonic": (
        "",
        "<|python_start|>[get_weather(city='''Zürich \"HB\"\n🙂 \\\\ end''', days=3, "
        'units="c", options={"hourly": true, "levels": [1, {"k": null}]}),'
        " get_time()]<|python_end|>",
    ),
    "llama3_json": (
        "",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich \\"HB\\"\\n🙂'
        ' \\\\ end", "days": 3, "units": "c", "options": {"hourly": true, "levels": [1,'
        ' {"k": null}]}}}; {"name": "get_time", "parameters": {}}',
    ),
    "phi4_mini_json": (
        "Checking.\n",
        'functools[{"name": "get_weather", "arguments": {"city": "Zürich \\"HB\\"\\n🙂 \\\\'
        ' end", "days": 3, "units": "c", "options": {"hourly": true, "levels": [1, {"k":'
        ' null}]}}}, {"name": "get_time", "arguments": {}}]',
    ),
}
PARSER_OF = {"mistral_list": "mistral", "llama4_pythonic": "pythonic"}


def parser_name(case: str) -> str:
    return PARSER_OF.get(case, case)


def summary(result):
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]


def streamed(parser, text: str, sizes) -> list:
    stream, deltas, i = parser.stream(), [], 0
    for size in sizes:
        if i >= len(text):
            break
        deltas.append(stream.feed(text[i : i + size]))
        i += size
    deltas.append(stream.feed(text[i:]))
    deltas.append(stream.finish())
    return deltas


def chunkings(text: str, count: int, seed: int = 1234) -> list[list[int]]:
    """One character per delta, all at once, and `count` random splits."""
    rng = random.Random(seed)
    sizes = [[1] * len(text), [len(text)]]
    return sizes + [[rng.randint(1, 24) for _ in range(len(text))] for _ in range(count)]


def assembled(parser, text: str, sizes):
    return summary(assemble(streamed(parser, text, sizes)))
