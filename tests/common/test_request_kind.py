"""A request is a generation (sampling_params) or a pooling request (pooling_params):
exactly one is set, wherever a request is built (frontend, engine core), and the error
names both; a worker plan's NewRequestData holds one `kind`, so it cannot hold both
(its wire form refuses neither: tests/common/test_convert_pooling.py)."""

from __future__ import annotations

import pytest

from services.common.engine_request import EngineCoreRequest
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import SamplingParams
from services.scheduler.request import Request

PARAMS = {
    "neither": {},
    "both": {"sampling_params": SamplingParams(), "pooling_params": PoolingParams()},
}


@pytest.mark.parametrize("kind", ["neither", "both"])
def test_neither_or_both_params_are_refused_by_name(kind):
    match = f"exactly one of sampling_params .* and pooling_params .*got {kind}"
    with pytest.raises(ValueError, match=match):
        EngineCoreRequest("r", [1, 2], **PARAMS[kind])
    with pytest.raises(ValueError, match=match):
        Request("r", [1, 2], **PARAMS[kind])


def test_a_pooling_request_needs_no_sampling_params():
    request = Request.from_engine_request(
        EngineCoreRequest("p", [1, 2, 3], pooling_params=PoolingParams()), block_size=16
    )
    assert request.is_pooling and request.sampling_params is None
    assert (request.num_sequences, request.uses_beam_search) == (1, False)
    assert not request.pending_fork and not request.needs_every_prompt_position
    request.pools_every_position = True  # what a MEAN / CLS engine sets at admission
    assert request.needs_every_prompt_position
    generation = Request("g", [1], SamplingParams(n=3, prompt_logprobs=1))
    assert not generation.is_pooling and generation.num_sequences == 3
    assert generation.pending_fork and generation.needs_every_prompt_position
