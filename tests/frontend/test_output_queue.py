"""RequestOutputQueue: a lagging consumer gets merged outputs (deltas concatenated,
cumulative ones replaced), an error comes after what was queued, and past the bound on
unread tokens `put` reports the overflow."""

import asyncio

import pytest

from services.common.outputs import CompletionOutput, Logprob, RequestOutput
from services.common.sampling_params import RequestOutputKind
from services.frontend.output_queue import RequestOutputQueue, merge_delta_outputs


def _output(*completions: CompletionOutput, finished: bool = False, metrics=None):
    return RequestOutput("r", "p", [1, 2], list(completions), finished, metrics=metrics or {})


def _completion(index: int, text: str, ids: list[int], finish=None, logprobs=None):
    return CompletionOutput(index, text, ids, logprobs=logprobs, finish_reason=finish)


def test_deltas_merge_per_index_in_order():
    lp = [{5: Logprob(-0.5)}]
    first = _output(_completion(0, "a", [5], logprobs=lp), metrics={"time_in_queue": 1.0})
    second = _output(
        _completion(0, "b", [6], finish="stop", logprobs=[{6: Logprob(-1.0)}]),
        _completion(1, "x", [9]),
        finished=True,
        metrics={"time_in_queue": 9.0},
    )
    merged = merge_delta_outputs(first, second)
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in merged.outputs] == [
        (0, "ab", [5, 6], "stop"),
        (1, "x", [9], None),
    ]
    assert [list(p) for p in merged.outputs[0].logprobs] == [[5], [6]]
    assert merged.finished and merged.metrics["time_in_queue"] == 1.0


async def test_a_lagging_consumer_gets_one_merged_delta():
    queue = RequestOutputQueue(RequestOutputKind.DELTA, max_unread_tokens=100)
    for i in range(10):
        assert queue.put(_output(_completion(0, str(i), [i])))
    assert queue.unread_tokens == 10
    merged = await queue.get()
    assert merged.outputs[0].text == "0123456789" and merged.outputs[0].token_ids == list(range(10))
    assert queue.unread_tokens == 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.get(), 0.05)  # nothing left


async def test_cumulative_outputs_are_replaced_and_count_only_unread_tokens():
    queue = RequestOutputQueue(RequestOutputKind.CUMULATIVE, max_unread_tokens=3)
    assert queue.put(_output(_completion(0, "ab", [1, 2])))
    assert (await queue.get()).outputs[0].text == "ab"
    assert queue.put(_output(_completion(0, "abc", [1, 2, 3])))
    assert queue.put(_output(_completion(0, "abcd", [1, 2, 3, 4])))
    assert queue.unread_tokens == 2
    assert (await queue.get()).outputs[0].token_ids == [1, 2, 3, 4]


async def test_the_bound_reports_an_overflow():
    queue = RequestOutputQueue(RequestOutputKind.DELTA, max_unread_tokens=4)
    assert queue.put(_output(_completion(0, "ab", [1, 2])))
    assert queue.put(_output(_completion(0, "cd", [3, 4])))
    assert not queue.put(_output(_completion(0, "e", [5])))
    unbounded = RequestOutputQueue(RequestOutputKind.DELTA, max_unread_tokens=0)
    assert all(unbounded.put(_output(_completion(0, "x", [1]))) for _ in range(10_000))


async def test_an_error_comes_after_the_queued_output():
    queue = RequestOutputQueue(RequestOutputKind.DELTA)
    queue.put(_output(_completion(0, "a", [1])))
    queue.put_error(RuntimeError("gone"))
    queue.put_error(ValueError("later errors are ignored"))
    assert (await queue.get()).outputs[0].text == "a"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="gone"):
            await queue.get()
