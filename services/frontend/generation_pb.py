"""Pure conversion for the public Generation API: GenerateRequest in, GenerateResponses out.

Requests become a GenerateCall (prompt, SamplingParams, the Frontend's keyword arguments);
every invalid value raises ValueError naming the field, so the servicer maps it straight to
INVALID_ARGUMENT. Responses are built by a ResponseBuilder, one per stream: it turns the
Frontend's delta RequestOutputs into one message per output index with something new, and
puts usage on the last message of the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import json_format, unknown_fields
from google.protobuf.message import Message

from services.common.convert import sampling as convert_sampling
from services.common.lora_request import LoRARequest
from services.common.outputs import CompletionOutput, Logprob, RequestOutput
from services.common.proto.pagestream.v1 import generation_pb2
from services.common.request_options import DEFAULT_OPTIONS, RequestOptions
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.common.served_model_info import ServedModelInfo
from services.frontend.chat_renderer import ChatRenderer, ChatTemplateError
from services.frontend.frontend_source import ModelListing
from services.frontend.input_processor import new_request_id
from services.frontend.lora_registry import LoRARegistry
from services.frontend.reply_parser import ReplyParser
from services.frontend.request_limits import LimitExceededError, RequestLimits

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class GenerateCall:
    """One GenerateRequest in the Frontend's terms: `frontend.generate(**call.arguments())`."""

    request_id: str
    prompt: str | dict
    sampling_params: SamplingParams
    options: RequestOptions = DEFAULT_OPTIONS

    def arguments(self) -> dict:
        return {
            "prompt": self.prompt,
            "sampling_params": self.sampling_params,
            "request_id": self.request_id,
            "options": self.options,
        }


# ---- requests ----------------------------------------------------------------------------
def generate_call_from_pb(
    request: generation_pb2.GenerateRequest,
    chat_text: str | None = None,
    defaults: dict | None = None,
    loras: LoRARegistry | None = None,
) -> GenerateCall:
    """Validate and convert; raises ValueError naming the offending field. `chat_text`:
    the chat prompt rendered (render_chat_pb), `loras`: the adapters `lora_name` may name."""
    reject_unknown_fields(request, "GenerateRequest")
    prompt, default_special = prompt_from_pb(request, chat_text)
    params = sampling_params_from_pb(request.sampling_params, defaults)
    special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    return GenerateCall(
        request_id=request.request_id or new_request_id(),
        prompt=prompt,
        sampling_params=params,
        options=RequestOptions(
            priority=request.priority,
            cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
            add_special_tokens=default_special if special is None else special,
            lora_request=_lora_of(request, loras),
        ),
    )


def _lora_of(request: generation_pb2.GenerateRequest, loras) -> LoRARequest | None:
    if not request.HasField("lora_name"):
        return None
    lora = loras.get(request.lora_name) if loras is not None else None
    if lora is None:
        served = ", ".join(sorted(loras.adapters)) if loras is not None else ""
        raise ValueError(
            f"lora_name {request.lora_name!r}: no such LoRA adapter is served "
            f"(served: {served or 'none'}; GetModelInfo lists them)."
        )
    return lora


def check_request_limits(request: generation_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """The frontend's size limits, before the chat template or the tokenizer runs."""
    which = request.WhichOneof("prompt")
    if which == "text":
        limits.check_prompt_text(request.text, "text")
    elif which == "token_ids":
        limits.check_token_ids(request.token_ids.token_ids, "token_ids")
    elif which == "chat":
        limits.check_messages([_text_pb(m) for m in request.chat.messages], "chat.messages")
    if request.sampling_params.HasField("n"):
        limits.check_n(request.sampling_params.n, "sampling_params.n")


def check_tokenize_limits(request: generation_pb2.TokenizeRequest, limits: RequestLimits) -> None:
    which = request.WhichOneof("input")
    if which == "text":
        limits.check_prompt_text(request.text, "text")
    elif which == "chat":
        limits.check_messages([_text_pb(m) for m in request.chat.messages], "chat.messages")


def _text_pb(message: generation_pb2.ChatMessage) -> str:
    """A message's text (its content, or its text parts), as far as limits are concerned."""
    return message.content + "".join(p.text for p in message.parts)


def chat_images_pb(chat: generation_pb2.ChatMessages) -> list:
    """The images of a chat's parts, in prompt order: encoded bytes or image_url strings."""
    return [
        getattr(part, part.WhichOneof("part"))
        for message in chat.messages
        for part in message.parts
        if part.WhichOneof("part") in ("image", "image_url")
    ]


def _message_pb(message: generation_pb2.ChatMessage, i: int) -> dict:
    """The dict the chat template sees: its content, or its parts (an image as
    {"type": "image"}, which the model's template renders as its image marker)."""
    if not message.parts:
        return {"role": message.role, "content": message.content}
    if message.content:
        raise ValueError(f"chat.messages[{i}]: set content or parts, not both.")
    parts = []
    for j, part in enumerate(message.parts):
        kind = part.WhichOneof("part")
        if kind is None:
            raise ValueError(f"chat.messages[{i}].parts[{j}]: set text, image or image_url.")
        parts.append({"type": "text", "text": part.text} if kind == "text" else {"type": "image"})
    return {"role": message.role, "content": parts}


def reject_unknown_fields(message, path: str) -> None:
    """Fields this server does not know (a newer client?) must not be silently ignored."""
    numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(message)})
    if numbers:
        raise ValueError(
            f"{path} has unknown field number(s) {numbers}: this server does not support them."
        )
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        if isinstance(value, Message):
            reject_unknown_fields(value, f"{path}.{field.name}")
        else:  # a repeated message field
            for i, item in enumerate(value):
                reject_unknown_fields(item, f"{path}.{field.name}[{i}]")


def prompt_from_pb(request, chat_text: str | None) -> tuple[str | dict, bool]:
    """The prompt oneof -> (prompt for Frontend.generate, default add_special_tokens)."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise ValueError("prompt: set one of text, token_ids or chat.")
    if which == "text":
        if not request.text:
            raise ValueError("text: the prompt is empty.")
        return request.text, True
    if which == "token_ids":
        if not request.token_ids.token_ids:
            raise ValueError("token_ids: the prompt is empty.")
        return {"prompt_token_ids": list(request.token_ids.token_ids)}, True
    if chat_text is None:
        raise ValueError("chat: the conversation was not rendered.")
    return chat_text, False


async def render_chat_pb(chat: generation_pb2.ChatMessages, renderer: ChatRenderer) -> str:
    """Render chat messages through the model's (or the request's, when the server trusts
    request templates) chat template."""
    if renderer.tokenizer is None:
        raise ValueError("chat: this model was loaded without a tokenizer.")
    if not chat.messages:
        raise ValueError("chat.messages: give at least one message.")
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise ValueError(
                f"chat.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; "
                f"got {message.role!r}."
            )
    messages = [_message_pb(m, i) for i, m in enumerate(chat.messages)]
    add_generation_prompt = (
        chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    )
    template = chat.chat_template if chat.HasField("chat_template") else None
    kwargs = (
        _integral(json_format.MessageToDict(chat.chat_template_kwargs))
        if chat.HasField("chat_template_kwargs")
        else None
    )
    try:
        return await renderer.render(
            messages, add_generation_prompt, request_template=template, template_kwargs=kwargs
        )
    except ChatTemplateError as exc:
        raise ValueError(f"chat.chat_template: {exc}") from exc
    except LimitExceededError as exc:
        raise ValueError(f"chat.{exc.param or 'chat_template'}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"chat: {exc}") from exc
    except Exception as exc:  # a broken template (jinja errors) is the client's input too
        raise ValueError(f"chat.chat_template could not be applied: {exc}") from exc


def _integral(value):
    """A Struct's numbers are doubles: whole ones go back to ints, as JSON would give them
    to the template (range(n) needs an int)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def sampling_params_from_pb(
    pb: generation_pb2.SamplingParams, defaults: dict | None = None
) -> SamplingParams:
    """Set fields win; unset ones take the model's generation_config defaults, else vLLM's.
    Streams want deltas. A client's `reasoning` bounds are dropped and its
    thinking_token_budget kept aside: the server sets the bounds from its own reasoning
    parser (bound_reasoning), which the budget's checks need."""
    budget = pb.thinking_token_budget if pb.HasField("thinking_token_budget") else None
    if budget is not None or pb.HasField("reasoning"):
        own = generation_pb2.SamplingParams()
        own.CopyFrom(pb)
        own.ClearField("thinking_token_budget")
        own.ClearField("reasoning")
        pb = own
    if budget is not None and budget < 0:
        raise ValueError(f"sampling_params.thinking_token_budget must be >= 0, got {budget}.")
    try:
        params = convert_sampling.sampling_params_from_pb(pb, defaults)
    except ValueError as exc:
        raise ValueError(f"sampling_params.{exc}") from exc
    params = params.clone(output_kind=RequestOutputKind.DELTA)
    params.thinking_token_budget = budget  # checked with the bounds (bound_reasoning)
    return params


# ---- responses ---------------------------------------------------------------------------
def logprobs_to_pb(
    positions: list[dict[int, Logprob] | None],
) -> list[generation_pb2.PositionLogprobs]:
    """One PositionLogprobs per position; None (the first prompt position) is an empty one."""
    return [
        generation_pb2.PositionLogprobs(
            entries=[
                generation_pb2.TokenLogprob(
                    token_id=token_id,
                    logprob=lp.logprob,
                    rank=lp.rank or 0,
                    token=lp.decoded_token or "",
                )
                for token_id, lp in (position or {}).items()
            ]
        )
        for position in positions
    ]


class ResponseBuilder:
    """Delta RequestOutputs -> GenerateResponses for one stream (per output index).
    `replies`: a chat's thinking split off into reasoning_text (a fresh ReplyParser per
    output index), with a reasoning parser."""

    def __init__(self, request_id: str, replies: Callable[[], ReplyParser] | None = None) -> None:
        self.request_id = request_id
        self.new_reply = replies
        self.replies: dict[int, ReplyParser] = {}
        self.finished_indices: set[int] = set()
        self.num_completion_tokens = 0
        self.sent_prompt_logprobs = False
        self.sent_final = False

    def responses(self, output: RequestOutput) -> list[generation_pb2.GenerateResponse]:
        """The messages for one output; the request's last one carries usage."""
        messages = []
        for completion in output.outputs:
            message = self._message(output, completion)
            if message is not None:
                messages.append(message)
        if output.finished and not self.sent_final:
            if not messages:  # nothing new: the usage still needs a message of its own
                messages.append(self._base(output, index=0))
            messages[-1].usage.CopyFrom(self.usage(output))
            self.sent_final = True
        return messages

    def usage(self, output: RequestOutput) -> generation_pb2.Usage:
        return generation_pb2.Usage(
            prompt_tokens=len(output.prompt_token_ids),
            completion_tokens=self.num_completion_tokens,
            cached_tokens=output.num_cached_tokens,
        )

    def _message(
        self, output: RequestOutput, completion: CompletionOutput
    ) -> generation_pb2.GenerateResponse | None:
        if completion.index in self.finished_indices:
            return None  # its end was sent; later outputs repeat its finish_reason
        ends_now = completion.finish_reason is not None
        if not (completion.token_ids or completion.text or ends_now):
            return None
        message = self._base(output, completion.index)
        self._set_text(message, completion.index, completion.text, ends_now)
        message.token_ids.extend(completion.token_ids)
        self.num_completion_tokens += len(completion.token_ids)
        if completion.logprobs:
            message.logprobs.extend(logprobs_to_pb(completion.logprobs))
        if completion.cumulative_logprob is not None:
            message.cumulative_logprob = completion.cumulative_logprob
        if ends_now:
            self.finished_indices.add(completion.index)
            _set_finish(message, completion)
        return message

    def _set_text(self, message, index: int, text: str, ends_now: bool) -> None:
        if self.new_reply is None:
            message.text = text
            return
        reply = self.replies.get(index)
        if reply is None:
            reply = self.replies[index] = self.new_reply()
        parsed = reply.feed(text, ends_now)
        message.text, message.reasoning_text = parsed.content, parsed.reasoning

    def _base(self, output: RequestOutput, index: int) -> generation_pb2.GenerateResponse:
        message = generation_pb2.GenerateResponse(
            request_id=self.request_id, index=index, num_cached_tokens=output.num_cached_tokens
        )
        if output.prompt_logprobs and not self.sent_prompt_logprobs:
            message.prompt_logprobs.extend(logprobs_to_pb(output.prompt_logprobs))
            self.sent_prompt_logprobs = True
        return message


def _set_finish(message: generation_pb2.GenerateResponse, completion: CompletionOutput) -> None:
    message.finish_reason = completion.finish_reason or ""
    reason = completion.stop_reason
    if isinstance(reason, bool) or reason is None:
        return
    if isinstance(reason, int):
        message.stop_token_id = reason
    elif isinstance(reason, str):
        message.stop_string = reason


# ---- the small RPCs ----------------------------------------------------------------------
def tokenize(
    request: generation_pb2.TokenizeRequest,
    tokenizer,
    info: ServedModelInfo,
    chat_text: str | None = None,
) -> generation_pb2.TokenizeResponse:
    """`chat_text`: the chat input rendered (render_chat_pb)."""
    which = request.WhichOneof("input")
    if which is None:
        raise ValueError("input: set one of text or chat.")
    if which == "text":
        text, default_special = request.text, True
    else:
        text, default_special = chat_text, False
    special = (
        request.add_special_tokens if request.HasField("add_special_tokens") else default_special
    )
    token_ids = tokenizer.encode(text, add_special_tokens=special)
    return generation_pb2.TokenizeResponse(
        token_ids=token_ids, count=len(token_ids), max_model_len=info.max_model_len
    )


def detokenize(
    request: generation_pb2.DetokenizeRequest, tokenizer, info: ServedModelInfo
) -> generation_pb2.DetokenizeResponse:
    token_ids = list(request.token_ids)
    if len(token_ids) > info.max_model_len:
        raise ValueError(
            f"token_ids has {len(token_ids)} ids, more than the maximum context length "
            f"max_model_len={info.max_model_len}."
        )
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < info.vocab_size:
            raise ValueError(
                f"token_ids[{i}] is {token_id}, outside the vocabulary [0, {info.vocab_size})."
            )
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return generation_pb2.DetokenizeResponse(
        text=tokenizer.decode(token_ids, skip_special_tokens=skip)
    )


def list_models_response(
    default: str, listings: list[ModelListing]
) -> generation_pb2.ListModelsResponse:
    models = [
        generation_pb2.ModelStatus(
            name=m.name,
            state=m.state,
            error=m.error or "",
            pinned=m.pinned,
            max_model_len=m.max_model_len,
        )
        for m in listings
    ]
    return generation_pb2.ListModelsResponse(models=models, default_model=default)
