"""The request fields that constrain output, turned into one StructuredOutputsParams.

OpenAI's `response_format`, vLLM's `structured_outputs` object and vLLM's older top-level
`guided_*` fields are all accepted. At most one constraint per request: two are a 400
naming both, never one silently winning; so is an unknown field or format type, and a
schema, regex or grammar llguidance cannot enforce (compiled here, so the error names the
field the client used).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.common.structured_outputs import StructuredOutputsParams, check_grammar
from services.frontend.openai.exceptions import InvalidRequestError

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` object; unknown keys (structural_tag, ...) are a 400."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: str | dict | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # vLLM's: there is no fallback backend here anyway

    def params(self) -> StructuredOutputsParams:
        fields = self.model_dump(exclude={"json_schema", "disable_fallback"})
        return StructuredOutputsParams(json=self.json_schema, **fields)


class StructuredOutputFields(BaseModel):
    """Mixed into the completions and chat request bodies.

    `response_format.json_schema.strict` is accepted and changes nothing, as in vLLM: the
    schema is always enforced exactly, and `additionalProperties` keeps JSON Schema's meaning
    (OpenAI's strict mode requires `additionalProperties: false` in the schema itself; set
    `structured_outputs.disable_additional_properties` to close every object).
    """

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint, compiled once to check it (None: unconstrained)."""
        sources = self._sources()
        if len(sources) > 1:
            names = " and ".join(name for name, _ in sources)
            raise InvalidRequestError(
                f"give at most one structured-output constraint; got {names}.", sources[1][0]
            )
        if self.guided_whitespace_pattern is not None and not sources:
            raise InvalidRequestError(
                "guided_whitespace_pattern needs a JSON constraint (guided_json, "
                "response_format json_object or json_schema).",
                "guided_whitespace_pattern",
            )
        if not sources:
            return None
        name, build = sources[0]
        if name == "structured_outputs" and self.guided_whitespace_pattern is not None:
            raise InvalidRequestError(
                "use structured_outputs.whitespace_pattern with structured_outputs.",
                "guided_whitespace_pattern",
            )
        try:
            params = build()
            check_grammar(params)
        except ValueError as exc:
            raise InvalidRequestError(f"{name}: {exc}", name) from exc
        return params

    def _sources(self) -> list[tuple[str, object]]:
        sources: list[tuple[str, object]] = []
        if self.response_format is not None and self.response_format.type != "text":
            sources.append(("response_format", self._from_response_format))
        if self.structured_outputs is not None:
            sources.append(("structured_outputs", self.structured_outputs.params))
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                sources.append((name, lambda kind=kind, value=value: self._guided(kind, value)))
        return sources

    def _guided(self, kind: str, value) -> StructuredOutputsParams:
        if self.guided_whitespace_pattern is not None and kind != "json":
            raise ValueError("guided_whitespace_pattern only applies to guided_json.")
        return StructuredOutputsParams(
            **{kind: value}, whitespace_pattern=self.guided_whitespace_pattern
        )

    def _from_response_format(self) -> StructuredOutputsParams:
        return response_format_params(self.response_format, self.guided_whitespace_pattern)


def response_format_params(
    fmt: ResponseFormat, whitespace_pattern: str | None = None
) -> StructuredOutputsParams:
    """A json_object / json_schema response format as a constraint (ValueError when it is
    none of the known types or lacks its schema); also the Responses API's text.format."""
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, whitespace_pattern=whitespace_pattern)
    if fmt.type != "json_schema":
        known = ", ".join(RESPONSE_FORMAT_TYPES)
        raise ValueError(f"type must be one of {known}; got {fmt.type!r}.")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ValueError("type json_schema needs json_schema.schema.")
    return StructuredOutputsParams(
        json=fmt.json_schema.json_schema, whitespace_pattern=whitespace_pattern
    )
