"""pagestream: an LLM inference and serving engine in the vLLM mould."""

from services.common.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams"]
__version__ = "0.1.0"
