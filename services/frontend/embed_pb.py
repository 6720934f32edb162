"""Pure conversion for the public Embed RPC: EmbedRequest in, EmbedResponse out.

Every invalid value raises ValueError naming the field (INVALID_ARGUMENT), before any
input is tokenized or admitted.
"""

from __future__ import annotations

from services.common.convert.pooling import pooling_params_from_pb
from services.common.outputs import PoolingRequestOutput
from services.common.pooling_params import PoolingParams
from services.common.proto.pagestream.v1 import generation_pb2
from services.frontend.generation_pb import reject_unknown_fields

MAX_EMBED_INPUTS = 2048  # inputs per request, as OpenAI's embeddings endpoint allows


def embed_inputs_from_pb(request: generation_pb2.EmbedRequest) -> list[str | dict]:
    """The prompts, in order: text, or {"prompt_token_ids": [...]}."""
    reject_unknown_fields(request, "EmbedRequest")
    if not request.inputs:
        raise ValueError("inputs: give at least one input to embed.")
    if len(request.inputs) > MAX_EMBED_INPUTS:
        raise ValueError(
            f"inputs: at most {MAX_EMBED_INPUTS} per request, got {len(request.inputs)}."
        )
    prompts: list[str | dict] = []
    for i, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind == "text":
            if not item.text:
                raise ValueError(f"inputs[{i}].text is empty.")
            prompts.append(item.text)
        elif kind == "token_ids":
            prompts.append({"prompt_token_ids": list(item.token_ids.token_ids)})
        else:
            raise ValueError(f"inputs[{i}]: set text or token_ids.")
    return prompts


def embed_params_from_pb(request: generation_pb2.EmbedRequest) -> PoolingParams:
    if not request.HasField("pooling_params"):
        return PoolingParams()
    return pooling_params_from_pb(request.pooling_params)


def embed_response(
    request_id: str, outputs: list[PoolingRequestOutput]
) -> generation_pb2.EmbedResponse:
    embeddings = [
        generation_pb2.Embedding(
            values=o.outputs.data.tolist(), prompt_tokens=len(o.prompt_token_ids)
        )
        for o in outputs
    ]
    prompt_tokens = sum(e.prompt_tokens for e in embeddings)
    cached = sum(o.num_cached_tokens for o in outputs)
    usage = generation_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens=cached)
    return generation_pb2.EmbedResponse(request_id=request_id, embeddings=embeddings, usage=usage)
