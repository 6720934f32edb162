"""POST /v1/messages and /v1/messages/count_tokens over the chat endpoint's machinery.

A Messages body is converted once into the internal chat request (chat_request.py), then
runs exactly as a chat completion does: OpenAIServingChat's model check, limits, tool plan
and build_job (chat template, prompt, SamplingParams), and ServingBase.run_job (admission,
the SSE response, aborting the request when the client goes away). Only the rendering is
this API's: MessageTracker and message_events. count_tokens renders the chat template and
tokenizes, as /tokenize does.
"""

from __future__ import annotations

import uuid

from fastapi import Request

from services.frontend.anthropic.chat_request import to_chat_request
from services.frontend.anthropic.message_stream import message_events
from services.frontend.anthropic.message_tracker import MessageTracker
from services.frontend.anthropic.messages_request import CountTokensRequest, MessagesRequest
from services.frontend.multimodal.image_prompt import image_prompt_ids
from services.frontend.openai.chat_rendering import render_chat_images
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.protocol import ChatCompletionRequest
from services.frontend.openai.serving_chat import OpenAIServingChat, message_text
from services.frontend.openai.tool_choice import plan_tools

__all__ = ["AnthropicServingMessages"]


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest, raw_request: Request):
        chat = self.chat
        model = chat.check_model(request.model)
        chat_request = to_chat_request(request)
        if chat.frontend.reasoning_parser is None:
            # Agent clients ask every model to think; one that cannot is answered anyway.
            chat_request.thinking_token_budget = None
        chat_request.check()
        chat.limits.check_tools(chat_request.tools)  # before a grammar is built from them
        self._check_auto_choice(chat_request)
        plan = plan_tools(chat_request, chat.tool_options)
        job = await chat.build_job(chat_request, model, plan, message_id())
        tracker = MessageTracker(job, chat.reply_parser(plan, job))
        return await chat.run_job(
            raw_request,
            job,
            tracker,
            request.stream,
            lambda first, outputs: message_events(tracker, first, outputs),
            tracker.message,
        )

    async def count_tokens(self, request: CountTokensRequest) -> dict:
        """The prompt's token count: the same conversion and chat template (tools included),
        rendered and tokenized only. Nothing is generated, so the context length does not
        bound it (a client counts to learn whether its conversation still fits) and no
        engine request, SamplingParams or metrics come of it; the frontend's limits on the
        messages and on the rendered prompt's size still bound the work. tool_choice and
        the thinking budget shape the output only, so they are left out (no grammar is
        built, no reasoning parser needed)."""
        chat = self.chat
        chat.check_model(request.model)
        chat_request = to_chat_request(request)
        chat.limits.check_tools(chat_request.tools)
        chat.limits.check_messages([message_text(m) for m in chat_request.messages])
        plan = plan_tools(
            chat_request.model_copy(update={"tool_choice": "none"}), chat.tool_options
        )
        text, images = await render_chat_images(
            chat.frontend,
            chat_request.messages,
            chat_request.add_generation_prompt,
            chat_request.chat_template,
            chat.tool_options.chat_template,
            plan.template_tools,
            template_kwargs=chat_request.chat_template_kwargs,
        )
        chat.limits.check_prompt_text(text, "messages")
        special = chat_request.add_special_tokens
        if images:  # each image counts as the tokens it expands to
            token_ids = await image_prompt_ids(chat.frontend, text, images, special)
        else:
            token_ids = chat.frontend.tokenizer.encode(text, add_special_tokens=special)
        return {"input_tokens": len(token_ids)}

    def _check_auto_choice(self, request: ChatCompletionRequest) -> None:
        """tool_choice auto (the default with tools) needs the server's tool-call parser;
        said in this API's terms rather than the chat endpoint's."""
        choice = request.tool_choice or ("auto" if request.tools else "none")
        options = self.chat.tool_options
        if choice == "auto" and not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise InvalidRequestError(
                'tool_choice {"type": "auto"} (the default with tools) needs the server to run '
                "with --enable-auto-tool-choice and --tool-call-parser; use "
                '{"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}.',
                "tool_choice",
            )
