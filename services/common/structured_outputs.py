"""StructuredOutputsParams and the one grammar every form of constraint becomes.

vLLM's `structured_outputs` fields on SamplingParams (the frontends turn OpenAI's
`response_format` and the older `guided_*` fields into these). `to_grammar` normalises
any of them to an llguidance grammar and `check_grammar` validates it: what llguidance
cannot enforce is refused with its reason, never dropped. JSON whitespace is bounded by
default (MAX_JSON_WHITESPACE), so a model cannot pad an object until max_tokens.
llguidance is torch-free, so the scheduler compiles these grammars itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_JSON_WHITESPACE = 16
BOUNDED_JSON_WHITESPACE = rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF / EBNF (has "::=")
    json_object: bool | None = None  # any JSON object
    whitespace_pattern: str | None = None  # a regex for JSON whitespace
    disable_any_whitespace: bool = False  # compact JSON only
    disable_additional_properties: bool = False  # objects take only the listed properties
    # Filled by __post_init__: the normalised grammar and its sha256 (the compile cache key).
    _grammar: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            given = ", ".join(kinds) or "none"
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given}."
            )
        object.__setattr__(self, "_grammar", _build(self, kinds[0]))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def grammar_text(self) -> str:
        """The llguidance grammar (TopLevelGrammar as JSON) this constraint compiles to."""
        return self._grammar

    @property
    def grammar_key(self) -> str:
        return hashlib.sha256(self._grammar.encode()).hexdigest()


def _build(params: StructuredOutputsParams, kind: str) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if kind == "regex":
        _check_text("regex", params.regex)
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark(_choice_lark(params.choice))
    if kind == "grammar":
        _check_text("grammar", params.grammar)
        lark = params.grammar
        if "::=" in lark:  # GBNF / EBNF (llama.cpp's form)
            try:
                lark = gbnf_to_lark(lark)
            except Exception as exc:
                raise ValueError(f"structured_outputs.grammar is not valid GBNF: {exc}") from exc
        return LLMatcher.grammar_from_lark(lark)
    schema = {"type": "object"} if kind == "json_object" else _schema(params.json)
    if params.disable_additional_properties:
        schema = _closed_objects(schema)
    return LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(params))


def _check_text(name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string.")


def _choice_lark(choice) -> str:
    if not isinstance(choice, list | tuple) or not choice:
        raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
    if not all(isinstance(c, str) for c in choice):
        raise ValueError("structured_outputs.choice must contain only strings.")
    # JSON string escapes are Lark string escapes: every choice is matched literally.
    return "start: " + " | ".join(json.dumps(c) for c in choice)


def _schema(value) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, Mapping):
        raise ValueError("structured_outputs.json must be a JSON schema object.")
    return dict(value)


def _json_options(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False}
    pattern = params.whitespace_pattern or BOUNDED_JSON_WHITESPACE
    return {"whitespace_flexible": True, "whitespace_pattern": pattern}


def _closed_objects(schema: Any) -> Any:
    """Every object schema without additionalProperties gets `false` (recursively)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed = {k: _closed_objects(v) for k, v in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and (
        "additionalProperties" not in closed
    ):
        closed["additionalProperties"] = False
    return closed


def check_grammar(params: StructuredOutputsParams) -> None:
    """ValueError naming the problem when llguidance cannot compile the constraint."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(params.grammar_text)
    if is_error:
        reason = " ".join(messages[0].split())
        raise ValueError(f"structured_outputs.{params.kind} is invalid: {reason}")
