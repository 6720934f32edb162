"""PoolingRequestState: a pooling request on the frontend, from its engine request to its
one output (the pooled vector as the worker finished it: pooled, truncated to the
request's dimensions and normalized as its PoolingParams ask; here it is only wrapped)."""

from __future__ import annotations

import time

from services.common.engine_output import EngineCoreOutput
from services.common.outputs import PoolingOutput, PoolingRequestOutput


class PoolingRequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0
        self.queued_s: float | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._output: PoolingRequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: EngineCoreOutput) -> str | None:
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.queued_s is not None and self.queued_s is None:
            self.queued_s = out.queued_s
        if not out.finished:
            return None
        self.finish_reason, self.error = out.finish_reason, out.error
        if out.pooled is not None:
            self.first_token_time = time.monotonic()
            self._output = PoolingRequestOutput(
                request_id=self.request_id,
                outputs=PoolingOutput(out.pooled),
                prompt_token_ids=self.prompt_token_ids,
                prompt=self.prompt,
                num_cached_tokens=self.num_cached_tokens,
            )
        return None

    def make_output(self) -> PoolingRequestOutput | None:
        """The one output, once it is finished (without `outputs` when it was aborted or
        failed: `error` says why)."""
        if not self.finished:
            return None
        if self._output is not None:
            return self._output
        return PoolingRequestOutput(
            request_id=self.request_id,
            outputs=None,
            prompt_token_ids=self.prompt_token_ids,
            prompt=self.prompt,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error or f"the request ended ({self.finish_reason}) without a result",
        )
