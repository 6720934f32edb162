"""ChunkEnvelope: a stream chunk built from the envelope serialised once is the very JSON
the chunk model serialises, for completions and chat chunks of every shape."""

import json

import pytest

from services.frontend.openai.replies import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatLogprobEntry,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from services.frontend.openai.serving_base import ChunkEnvelope

COMPLETION_CHOICES = [
    [CompletionChoice(index=0, text='héllo "quoted" \n')],
    [CompletionChoice(index=3, text="", finish_reason="stop", stop_reason="</s>")],
    [
        CompletionChoice(
            index=1,
            text=" a",
            logprobs=CompletionLogProbs(
                tokens=[" a"], token_logprobs=[-0.5], top_logprobs=[{" a": -0.5}], text_offset=[0]
            ),
        ),
        CompletionChoice(index=2, text="💡", finish_reason="length"),
    ],
]

CHAT_CHOICES = [
    [ChatStreamChoice(index=0, delta=DeltaMessage(content="x\ty"))],
    [ChatStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop", stop_reason=2)],
    [
        ChatStreamChoice(
            index=1,
            delta=DeltaMessage(
                tool_calls=[
                    DeltaToolCall(
                        index=0,
                        id="call_1",
                        function=DeltaFunctionCall(name="f", arguments='{"a": 1}'),
                    )
                ]
            ),
            logprobs=ChatChoiceLogprobs(
                content=[ChatLogprobEntry(token="x", logprob=-1.0, bytes=[120], top_logprobs=[])]
            ),
        )
    ],
]


@pytest.mark.parametrize("choices", COMPLETION_CHOICES)
def test_completion_chunks_match_the_model(choices):
    envelope = ChunkEnvelope(CompletionResponse(id="cmpl-1", model="m", choices=[]))
    model = CompletionResponse(id="cmpl-1", created=envelope.created, model="m", choices=choices)
    assert envelope.json(choices) == model.model_dump_json()
    assert json.loads(envelope.json(choices))["choices"][0]["index"] == choices[0].index


@pytest.mark.parametrize("choices", CHAT_CHOICES)
def test_chat_chunks_match_the_model(choices):
    envelope = ChunkEnvelope(ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[]))
    model = ChatCompletionChunk(
        id="chatcmpl-1", created=envelope.created, model="m", choices=choices
    )
    assert envelope.json(choices) == model.model_dump_json()
    assert json.loads(envelope.json(choices))["object"] == "chat.completion.chunk"


def test_an_empty_choice_list_is_the_envelope_itself():
    empty = CompletionResponse(id="cmpl-2", model="m", choices=[])
    assert ChunkEnvelope(empty).json([]) == empty.model_dump_json()
