"""ChatRenderer: a conversation to prompt text, through the one template it should use.

The model's template and the operator's --chat-template are the server's own: they render
inline (Jinja compiles each once; transformers caches the compiled template by its text).
A request's own `chat_template` is a program written by the client: refused unless the
operator passed --trust-request-chat-template, bounded in size, and then rendered in the
TemplateSandbox's child process, with a timeout and bounded memory and output, never on
the event loop. The OpenAI, Responses and gRPC APIs all render through here.
"""

from __future__ import annotations

from services.frontend.chat_templates import render_conversation
from services.frontend.chat_templates.template_sandbox import ChatTemplateError, TemplateSandbox
from services.frontend.frontend_config import FrontendConfig
from services.frontend.request_limits import LimitExceededError

__all__ = ["ChatRenderer", "ChatTemplateError"]

PARAM = "chat_template"
KWARGS_PARAM = "chat_template_kwargs"
# Names apply_chat_template gives the template itself (or takes as its own options): a
# request's chat_template_kwargs may not replace them.
RESERVED_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "add_generation_prompt",
        "continue_final_message", "chat_template", "tokenize", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs", "bos_token", "eos_token", "raise_exception", "strftime_now",
        # Jinja's own globals: a template calls them
        "range", "dict", "lipsum", "cycler", "joiner", "namespace",
    }
)  # fmt: skip


class ChatRenderer:
    def __init__(self, tokenizer, config: FrontendConfig, max_output_bytes: int) -> None:
        """`max_output_bytes`: the prompt-size limit a request's template renders within
        (0, no limit: the request body's, else the sandbox's memory bounds it)."""
        self.tokenizer = tokenizer
        self.config = config
        self.max_output_bytes = max_output_bytes or config.max_request_body_bytes or 2**31
        self.default_kwargs = config.chat_template_kwargs
        self._sandbox: TemplateSandbox | None = None

    def template_kwargs(self, requested: dict | None) -> dict:
        """The template's own variables: the server's defaults, then the request's."""
        for key in requested or {}:
            if key in RESERVED_KWARGS or not key.isidentifier():
                raise LimitExceededError(
                    f"chat_template_kwargs may not set {key!r}: it is not a template "
                    "variable a request may choose.",
                    KWARGS_PARAM,
                )
        return {**self.default_kwargs, **(requested or {})}

    def check_request_template(self, template: str | None) -> None:
        """A request's own template: allowed at all, and within its size (400 otherwise)."""
        if template is None:
            return
        if not self.config.trust_request_chat_template:
            raise LimitExceededError(
                "chat_template: this server does not render chat templates sent in requests "
                "(a template is a program it would run); its operator can allow them with "
                "--trust-request-chat-template.",
                PARAM,
            )
        size = len(template.encode("utf-8", "surrogatepass"))
        limit = self.config.max_chat_template_bytes
        if limit and size > limit:
            raise LimitExceededError(
                f"chat_template is {size} bytes, more than the limit of {limit} "
                "(max_chat_template_bytes, --max-chat-template-bytes).",
                PARAM,
            )

    async def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        request_template: str | None = None,
        server_template: str | None = None,
        tools: list[dict] | None = None,
        uses_tools: bool = False,
        template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text. A bad request template is ChatTemplateError; the server's own
        templates raise what Jinja and apply_chat_template raise (callers name the field).
        `template_kwargs`: the request's chat_template_kwargs (over the server's)."""
        self.check_request_template(request_template)
        kwargs = self.template_kwargs(template_kwargs)
        if request_template is None:
            return render_conversation(
                self.tokenizer,
                messages,
                add_generation_prompt,
                server_template,
                tools,
                uses_tools,
                kwargs,
            )
        return await self._sandboxed().render(
            messages, add_generation_prompt, request_template, tools, uses_tools, kwargs
        )

    def _sandboxed(self) -> TemplateSandbox:
        if self._sandbox is None:
            timeout = self.config.chat_template_timeout_s
            self._sandbox = TemplateSandbox(self.tokenizer, timeout, self.max_output_bytes)
        return self._sandbox

    async def close(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()
