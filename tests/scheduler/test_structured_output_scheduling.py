"""The scheduler's side of structured outputs, with the torch-free stand-in worker (which
ignores the masks, so its tokens are whatever its hash says): grammars compile off the
step thread while other requests run, a grammar that is late or broken fails only its
request, masks go only to rows that sample, and a token the grammar rejects ends the
request with an error instead of carrying on."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output_manager import StructuredOutputManager
from tests.helpers.tiny_tokenizer import build_tokenizer
from tests.scheduler.stand_in_worker import VOCAB_SIZE, StandInWorker, make_request

TOKENIZER_JSON = build_tokenizer().backend_tokenizer.to_str()


def _scheduler(manager: StructuredOutputManager, **config) -> tuple[Scheduler, StandInWorker]:
    config.setdefault("max_model_len", 2048)
    scheduler = Scheduler(
        SchedulerConfig(**config),
        CacheConfig(block_size=16),
        num_device_blocks=64,
        structured=manager,
    )
    return scheduler, StandInWorker(64, 16, 0)


def _manager(**kwargs) -> StructuredOutputManager:
    return StructuredOutputManager(lambda: TOKENIZER_JSON, VOCAB_SIZE, [0], **kwargs)


def _step(scheduler: Scheduler, worker: StandInWorker):
    plan = scheduler.schedule()
    outputs = scheduler.update_from_output(plan, worker.execute(plan))
    return plan, [o for batch in outputs.values() for o in batch.outputs]


def _wait_compiled(request) -> None:
    request.grammar.future.result(timeout=30)


def test_a_compiling_grammar_lets_others_run_first(monkeypatch):
    manager = _manager()
    gate = threading.Event()
    compile_ = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda g: (gate.wait(30), compile_(g))[1])
    scheduler, worker = _scheduler(manager)
    constrained = make_request("c", [5, 6, 7], temperature=1.0, structured_outputs={"regex": "a+"})
    scheduler.add_request(constrained)
    scheduler.add_request(make_request("plain", [8, 9], max_tokens=3))
    plan, _ = _step(scheduler, worker)
    assert list(plan.num_scheduled_tokens) == ["plain"]  # "c" waits, not blocking the queue
    assert scheduler.waiting[0] is constrained
    gate.set()
    _wait_compiled(constrained)
    plan, _ = _step(scheduler, worker)
    assert "c" in plan.num_scheduled_tokens and plan.grammar_request_ids == ["c"]
    words = np.frombuffer(plan.grammar_bitmask, dtype="<i4")
    assert words.shape == ((VOCAB_SIZE + 31) // 32,)
    allowed = [t for t in range(VOCAB_SIZE) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert allowed and all("a" in manager.tokenizer().decode_str([t]) for t in allowed)


def test_a_grammar_past_its_deadline_fails_only_its_request(monkeypatch):
    manager = _manager(compile_timeout_s=0.05)
    gate = threading.Event()
    monkeypatch.setattr(manager, "_compile", lambda g: gate.wait(30))
    scheduler, worker = _scheduler(manager)
    scheduler.add_request(make_request("slow", [1, 2], structured_outputs={"regex": "b+"}))
    scheduler.add_request(make_request("plain", [3, 4], max_tokens=2))
    time.sleep(0.1)
    _, outputs = _step(scheduler, worker)
    gate.set()
    errors = [o for o in outputs if o.request_id == "slow"]
    assert errors and errors[0].finish_reason == "error"
    assert "did not compile within" in errors[0].error
    assert not scheduler.waiting or scheduler.waiting[0].request_id != "slow"


def test_a_token_the_grammar_rejects_ends_the_request_with_an_error():
    manager = _manager()
    scheduler, worker = _scheduler(manager)
    request = make_request("r", [5, 6, 7], max_tokens=20, structured_outputs={"regex": "a{20}"})
    scheduler.add_request(request)
    _wait_compiled(request)
    finals = []
    for _ in range(10):
        _, outputs = _step(scheduler, worker)
        finals += [o for o in outputs if o.finished]
        if finals:
            break
    # The stand-in ignores the mask: its first token is not "a", and the request says so.
    [final] = finals
    assert final.finish_reason == "error" and final.error_code == "internal"
    assert "not allowed by the request's grammar" in final.error
    assert request.status == RequestStatus.FINISHED_ERROR
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks  # nothing leaked


def test_partial_prefill_chunks_get_no_mask():
    manager = _manager()
    scheduler, worker = _scheduler(manager, max_num_batched_tokens=16)
    request = make_request("long", list(range(1, 41)), structured_outputs={"choice": ["x"]})
    scheduler.add_request(request)
    _wait_compiled(request)
    plans = [_step(scheduler, worker)[0] for _ in range(3)]
    assert [p.num_scheduled_tokens.get("long") for p in plans] == [16, 16, 8]
    assert [p.grammar_request_ids for p in plans] == [[], [], ["long"]]


def test_n_2_sequences_each_get_their_own_matcher():
    manager = _manager()
    scheduler, worker = _scheduler(manager)
    request = make_request(
        "g", [5, 6, 7], n=2, temperature=1.0, structured_outputs={"grammar": 'start: "q"*'}
    )
    scheduler.add_request(request)
    _wait_compiled(request)
    _step(scheduler, worker)  # the prompt up to its last token
    plan = scheduler.schedule()  # forked: both sequences sample
    assert sorted(plan.grammar_request_ids) == ["g", "g#1"]
    child = scheduler.requests["g#1"]
    assert child.grammar.matcher is not request.grammar.matcher
    scheduler.update_from_output(plan, worker.execute(plan))


def test_without_a_tokenizer_constrained_requests_are_refused():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(), num_device_blocks=8)
    with pytest.raises(ValueError, match="tokenizer"):
        scheduler.add_request(make_request("r", [1, 2], structured_outputs={"regex": "a"}))


def test_compiling_and_masking_load_no_torch(tmp_path):
    """The scheduler's grammar work (llguidance, numpy) never pulls torch in: checked in a
    fresh interpreter that compiles a grammar and fills a mask."""
    import subprocess
    import sys

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(TOKENIZER_JSON, encoding="utf-8")
    code = f"""
import sys
from services.common.structured_outputs import StructuredOutputsParams
from services.scheduler.structured_output_manager import StructuredOutputManager
from services.scheduler.request import Request
from services.common.sampling_params import SamplingParams
manager = StructuredOutputManager(lambda: open({str(tokenizer)!r}).read(), 512, [2])
params = SamplingParams(structured_outputs=StructuredOutputsParams(json={{"type": "object"}}))
request = Request("r", [1, 2], params)
manager.admit(request)
request.grammar.future.result(timeout=30)
assert manager.ready(request)
masks = manager.masks([request], {{"r": 2}})
assert masks.request_ids == ["r"] and len(masks.bitmask) == 16 * 4
assert "torch" not in sys.modules, "torch was imported"
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
