"""ToolServerOptions: the server's tool-calling flags (--enable-auto-tool-choice,
--tool-call-parser, --chat-template), checked at start; what a chat request's tools mean
under them is services/frontend/openai/tool_choice.py."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from services.common.flags import flag
from services.frontend.tool_parsers import TOOL_PARSERS, detect_tool_parser, get_tool_parser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolServerOptions:
    """The server's flags: --enable-auto-tool-choice, --tool-call-parser, --chat-template."""

    enable_auto_tool_choice: bool = flag(
        False,
        'allow tool_choice "auto": the model decides, its output is parsed for calls (in the '
        "--tool-call-parser format, else the one the chat template shows)",
    )
    tool_call_parser: str | None = flag(
        None,
        'the model\'s tool-call format: parses "auto" replies and shapes the grammar of '
        '"required" / named-function requests (default: detected from the chat template, '
        'else hermes for "required" / named functions)',
        choices=sorted(TOOL_PARSERS),
    )
    chat_template: str | None = flag(
        None, "a chat template file, or the template itself, instead of the model's"
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at startup

    def for_template(self, chat_template: str | None) -> ToolServerOptions:
        """These options once the model's chat template is known: without
        --tool-call-parser, the parser its template shows (detect.py), if any. Without
        one, "auto" requests keep getting the 400 that names --tool-call-parser."""
        if self.tool_call_parser is not None:
            return self
        detected = detect_tool_parser(chat_template)
        if detected is None:
            return self
        logger.info("tool-call parser: %s (detected from the chat template)", detected)
        return dataclasses.replace(self, tool_call_parser=detected)
