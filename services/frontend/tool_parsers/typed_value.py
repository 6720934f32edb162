"""A parameter value written as text (qwen3_coder's XML) read as the JSON value its schema
types ask for, the way vLLM's qwen3_coder parser reads it (the rules: `read_value`). A
value that fits none of its types is kept as text: the client sees what the model wrote.
"""

from __future__ import annotations

import ast
import json
import re
import warnings

_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NOT_READ = object()


def to_json(text: str, value_types: list[str]) -> str:
    """The JSON text of the value (json.dumps' separators, non-ASCII kept)."""
    written = dumps(read_value(text, value_types))
    return written if written is not None else dumps(text)


def dumps(value) -> str | None:
    """JSON text, or None for what JSON cannot hold (NaN, sets, bytes). A lone surrogate
    (a Python or JSON escape can make one) is written escaped: it has no UTF-8 form."""
    try:
        written = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    try:
        written.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    return written


def read_python_or_json(text: str):
    """JSON first (its meaning wins where the two differ, as for "\\/"), else a Python
    literal; _NOT_READ when neither."""
    found = _json(text)
    if found is not _NOT_READ:
        return found
    try:
        return _literal(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NOT_READ


NOT_READ = _NOT_READ


def read_value(text: str, value_types: list[str]):
    """The value `text` stands for:

    - string: the text as is; integer / number: a JSON number (an integral number is written
      as an integer); boolean: true / false (any case); null: null or None;
    - object / array: JSON, else a Python literal (models trained on Python reprs write
      {'k': 'v'}), else the text;
    - several types: each non-string type in turn, then the text if string is among them;
    - no type (an unknown parameter, a schema without one): JSON, else the text.
    """

    if not value_types:
        found = _json(text.strip())
        return text if found is _NOT_READ else found
    stripped = text.strip()
    for kind in value_types:
        if kind == "string":
            continue
        found = _READERS[kind](stripped)
        if found is not _NOT_READ:
            return found
    return text


def _integer(text: str):
    if _INTEGER.fullmatch(text):
        return int(text)
    found = _number(text)
    return found if isinstance(found, int) else _NOT_READ


def _number(text: str):
    if not _NUMBER.fullmatch(text):
        return _NOT_READ
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except (ValueError, OverflowError):  # more digits than int() reads
        return _NOT_READ
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return _NOT_READ
        if value.is_integer() and abs(value) < 2**53:
            return int(value)
    return value


def _boolean(text: str):
    lowered = text.lower()
    return lowered == "true" if lowered in ("true", "false") else _NOT_READ


def _null(text: str):
    return None if text in ("null", "None") else _NOT_READ


def _container(kind: type):
    def read(text: str):
        found = _json(text)
        if isinstance(found, kind):
            return found
        try:
            found = _literal(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _NOT_READ
        return found if isinstance(found, kind) else _NOT_READ

    return read


def _literal(text: str):
    """ast.literal_eval without its warnings: a model's "\\d" in a string is an invalid
    escape to Python (a DeprecationWarning / SyntaxWarning per value), kept as written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.literal_eval(text)


def _json(text: str):
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return _NOT_READ


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_READERS = {
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
    "object": _container(dict),
    "array": _container((list, tuple)),
}
