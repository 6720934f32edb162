"""RequestOutputQueue: one request's outputs on their way to a consumer that may lag.

The engine never waits for a consumer: outputs the consumer has not taken yet are merged
into one (delta outputs concatenated, cumulative ones replaced by the newest), so a queue
holds at most one output however far its reader falls behind. What it holds is bounded
too: once more than `max_unread_tokens` tokens wait unread, `put` reports an overflow and
the Frontend aborts the request (a client that stopped reading must not keep a sequence
running in the engine). An error (the engine is gone, the request timed out) is handed
out after what was already queued.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.common.outputs import CompletionOutput, RequestOutput
from services.common.sampling_params import RequestOutputKind

__all__ = ["RequestOutputQueue", "SlowConsumerError", "merge_delta_outputs"]


class SlowConsumerError(RuntimeError):
    """The request's consumer stopped reading; the request was aborted."""


class RequestOutputQueue:
    def __init__(self, output_kind: RequestOutputKind, max_unread_tokens: int = 0) -> None:
        self.delta = output_kind == RequestOutputKind.DELTA
        self.max_unread_tokens = max_unread_tokens
        self.unread_tokens = 0
        self._num_taken_tokens = 0  # cumulative outputs: tokens in the last one taken
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> bool:
        """Queue (merge) an output; False when the unread tokens now exceed the bound."""
        if self._pending is None:
            self._pending = output
        elif self.delta:
            self._pending = merge_delta_outputs(self._pending, output)
        else:
            self._pending = output  # a cumulative output supersedes the older one
        self.unread_tokens = _num_tokens(self._pending) - self._num_taken_tokens
        self._ready.set()
        return not (self.max_unread_tokens and self.unread_tokens > self.max_unread_tokens)

    def put_error(self, error: BaseException) -> None:
        """End the stream with `error` (after any queued output); the first error wins."""
        if self._error is None:
            self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next (merged) output; raises the queued error once the outputs are taken."""
        await self._ready.wait()
        if self._pending is not None:
            output, self._pending, self.unread_tokens = self._pending, None, 0
            if not self.delta:
                self._num_taken_tokens = _num_tokens(output)
            if self._error is None:
                self._ready.clear()
            return output
        raise self._error


def _num_tokens(output: RequestOutput) -> int:
    if not isinstance(output, RequestOutput):
        return 0  # a pooling request's one output carries no tokens
    return sum(len(o.token_ids) for o in output.outputs)


def merge_delta_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One delta output equal to `older` followed by `newer` (same request)."""
    completions = {o.index: o for o in older.outputs}
    for new in newer.outputs:
        old = completions.get(new.index)
        completions[new.index] = new if old is None else _merge_completion(old, new)
    return replace(
        newer,
        outputs=[completions[i] for i in sorted(completions)],
        metrics={**newer.metrics, **older.metrics},  # first-output metrics stay the first's
    )


def _merge_completion(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = None
    if old.logprobs is not None or new.logprobs is not None:
        logprobs = (old.logprobs or []) + (new.logprobs or [])
    return CompletionOutput(
        index=new.index,
        text=old.text + new.text,
        token_ids=old.token_ids + new.token_ids,
        cumulative_logprob=new.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=new.finish_reason or old.finish_reason,
        stop_reason=new.stop_reason if new.finish_reason else old.stop_reason,
    )
