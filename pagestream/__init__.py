"""pagestream: an LLM inference and serving engine in the vLLM mould."""

from services.common.lora_request import LoRARequest
from services.common.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from services.common.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine classes pull in torch and transformers: import them on first use.
    if name == "LLM":
        from pagestream.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from pagestream.async_engine import AsyncEngine

        return AsyncEngine
    if name == "EngineArgs":
        from pagestream.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
