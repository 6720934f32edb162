"""What a chat request's `tools` / `tool_choice` / `parallel_tool_calls` mean for the
engine request (vLLM's semantics; each choice's rule: `plan_tools`). Every mode reads
the output with one parser format, so "required" and named choices are constrained by a
grammar in that same format.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.structured_outputs import StructuredOutputsParams, check_grammar
from services.frontend.openai.chat_messages import ChatTool, NamedToolChoice
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.tool_options import ToolServerOptions
from services.frontend.tool_parsers import ToolParser, get_tool_parser

DEFAULT_CONSTRAINT_FORMAT = "hermes"


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None  # what the chat template sees
    parser: ToolParser | None = None  # None: the output is not parsed for calls
    constraint: StructuredOutputsParams | None = None


def plan_tools(request, options: ToolServerOptions) -> ToolPlan:
    """The plan of a chat request's tools:

    - no tool_choice: "auto" when there are tools, else "none".
    - "none": tools still go into the prompt (the model may know them), the output is text.
    - "auto": needs --enable-auto-tool-choice and a parser (--tool-call-parser, or the one
      detected from the chat template: ToolServerOptions.for_template; else 400 saying so); the
      output is parsed for calls in the parser's format.
    - "required" / a named function: the output is constrained by a grammar in the parser's
      own format (--tool-call-parser, else hermes), so the same parser reads every mode; the
      arguments are constrained by each tool's `parameters` schema. A named function is one
      call; "required" is one or more calls, one when parallel_tool_calls is false.
    """

    tools: list[ChatTool] = request.tools or []
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise InvalidRequestError("tool_choice needs tools.", "tool_choice")
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(template_tools)
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise InvalidRequestError(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                'and --tool-call-parser; use tool_choice "required" or a named function, or '
                '"none".',
                "tool_choice",
            )
        parser_cls = get_tool_parser(options.tool_call_parser)
        parser = parser_cls(None if parallel else 1, tools=_specs(tools, range(len(tools))))
        return ToolPlan(template_tools, parser)
    parser_cls = get_tool_parser(options.tool_call_parser or DEFAULT_CONSTRAINT_FORMAT)
    selected = _selected(tools, choice)
    if isinstance(choice, NamedToolChoice):
        parallel = False
    specs = _specs(tools, selected)
    parser = parser_cls(None if parallel else 1, tools=specs)
    return ToolPlan(template_tools, parser, _constraint(parser, tools, selected, parallel))


def _specs(tools: list[ChatTool], indices) -> list[dict]:
    """The functions as parsers and grammars take them: {"name", "parameters"} each."""
    return [
        {"name": tools[i].function.name, "parameters": tools[i].function.parameters}
        for i in indices
    ]


def _selected(tools: list[ChatTool], choice) -> list[int]:
    if not isinstance(choice, NamedToolChoice):
        return list(range(len(tools)))
    name = choice.function.name
    found = [i for i, t in enumerate(tools) if t.function.name == name]
    if not found:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not in tools.", "tool_choice"
        )
    return found[:1]


def _constraint(
    parser: ToolParser, tools: list[ChatTool], selected: list[int], parallel: bool
) -> StructuredOutputsParams:
    specs = []
    for i in selected:
        function = tools[i].function
        if function.parameters is not None:
            _check_parameters(i, function.parameters)
        specs.append({"name": function.name, "parameters": function.parameters})
    try:  # a schema the format's grammar cannot carry is the request's fault, as is one
        # llguidance refuses
        params = StructuredOutputsParams(grammar=parser.constraint_grammar(specs, parallel))
        check_grammar(params)
    except ValueError as exc:
        raise InvalidRequestError(f"tools: {exc}", "tools") from exc
    return params


def _check_parameters(index: int, parameters: dict) -> None:
    """The schema on its own first, so the error names the tool."""
    where = f"tools[{index}].function.parameters"
    try:
        check_grammar(StructuredOutputsParams(json=parameters))
    except ValueError as exc:
        raise InvalidRequestError(f"{where}: {exc}", "tools") from exc
