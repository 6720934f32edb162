"""ToolServerOptions: the server's tool-calling flags (--enable-auto-tool-choice,
--tool-call-parser, --chat-template), checked at start; what a chat request's tools mean
under them is services/frontend/openai/tool_choice.py."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.flags import flag
from services.frontend.tool_parsers import TOOL_PARSERS, get_tool_parser


@dataclass(frozen=True)
class ToolServerOptions:
    """The server's flags: --enable-auto-tool-choice, --tool-call-parser, --chat-template."""

    enable_auto_tool_choice: bool = flag(
        False,
        'allow tool_choice "auto": the model decides, its output is parsed for calls (needs '
        "--tool-call-parser)",
    )
    tool_call_parser: str | None = flag(
        None,
        'the model\'s tool-call format: parses "auto" replies and shapes the grammar of '
        '"required" / named-function requests (default for those: hermes)',
        choices=sorted(TOOL_PARSERS),
    )
    chat_template: str | None = flag(
        None, "a chat template file, or the template itself, instead of the model's"
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at startup
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
