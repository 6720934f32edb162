"""The engine's side of reasoning models: a sequence's ReasoningPhase (thinking, its end
marker, the budget that forces the end), the structured-output manager consulting it (no
grammar before the answer, one-token rows while the end is forced, no proposals verified
while thinking), and the scheduler running it with a stand-in worker that obeys one-token
rows, through preemption and n > 1 forks."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.config import CacheConfig, SchedulerConfig
from services.common.reasoning_bounds import ReasoningBounds, ReasoningMode
from services.common.runner_output import RunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.admission import RequestRejectedError
from services.scheduler.reasoning_phase import ReasoningPhase
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output_manager import StructuredOutputManager
from tests.helpers.tiny_tokenizer import build_tokenizer
from tests.scheduler.stand_in_worker import (
    VOCAB_SIZE,
    StandInWorker,
    accurate,
    make_request,
    reference_generate,
)

TOKENIZER_JSON = build_tokenizer().backend_tokenizer.to_str()
START, END_A, END_B, NEWLINE = 900, 901, 902, 903
THINK = ReasoningBounds(ReasoningMode.THINKING, (START,), (END_A, END_B), (NEWLINE, END_A, END_B))
OPTIONAL = ReasoningBounds(ReasoningMode.OPTIONAL, (START,), (END_A, END_B), (END_A, END_B))
GRAMMAR = {"regex": "a+"}


def _phase(bounds: ReasoningBounds = THINK, budget: int | None = None, **params):
    phase = ReasoningPhase.for_params(
        SamplingParams(reasoning=bounds, thinking_token_budget=budget, **params)
    )
    assert phase is not None
    return phase


def _feed(phase: ReasoningPhase, tokens: list[int], output: list[int] | None = None) -> list[bool]:
    """Advance over tokens; whether each was the answer's."""
    output = [] if output is None else output
    answers = []
    for token in tokens:
        output.append(token)
        answers.append(phase.advance(token, output))
    return answers


# ---- the state machine -----------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        {},  # no bounds
        {"reasoning": THINK},  # bounds, but neither a grammar nor a budget to apply
        {"reasoning": ReasoningBounds(end_token_ids=(1,), forced_end_token_ids=(1,))}
        | {"thinking_token_budget": 3},  # ANSWER: nothing to think
        {"reasoning": ReasoningBounds(ReasoningMode.OPTIONAL, (5, 6), (7,), (7,))}
        | {"thinking_token_budget": 3},  # a multi-token start: taken as ANSWER
    ],
)
def test_sequences_the_engine_has_nothing_to_do_for_get_no_phase(params):
    assert ReasoningPhase.for_params(SamplingParams(**params)) is None


def test_thinking_ends_only_when_the_whole_end_marker_is_written():
    phase = _phase(structured_outputs=GRAMMAR)
    assert _feed(phase, [5, END_A, 6, END_B, END_A]) == [False] * 5
    assert not phase.answering and phase.forced_token() is None  # no budget: never forced
    assert _feed(phase, [END_B], [5, END_A, 6, END_B, END_A]) == [False]  # the marker's end
    assert phase.answering and phase.num_thought == 6
    assert _feed(phase, [7, END_A, END_B]) == [True, True, True]  # the answer from here on


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_a_budget_of_n_forces_the_end_after_n_thinking_tokens(budget):
    phase = _phase(budget=budget)
    output: list[int] = []
    for token in range(10, 10 + budget):
        assert phase.forced_token() is None
        assert _feed(phase, [token], output) == [False]
    forced = []
    while (token := phase.forced_token()) is not None:
        forced.append(token)
        assert _feed(phase, [token], output) == [False]
    # The end marker inside the forced ids does not end the phase before the newline.
    assert forced == [NEWLINE, END_A, END_B]
    assert phase.answering and phase.num_thought == budget
    assert _feed(phase, [5], output) == [True]


def test_an_end_written_within_the_budget_forces_nothing():
    phase = _phase(budget=3)
    assert _feed(phase, [5, END_A, END_B]) == [False] * 3
    assert phase.answering and phase.forced_token() is None


def test_optional_with_the_start_token_thinks_and_counts_from_the_next_token():
    phase = _phase(OPTIONAL, budget=2)
    assert phase.start_token == START and phase.forced_token() is None
    assert _feed(phase, [START]) == [False]
    assert phase.start_token is None and phase.num_thought == 0
    output = [START]
    assert _feed(phase, [5, 6], output) == [False, False]
    assert [phase.forced_token(), _feed(phase, [END_A], output)] == [END_A, [False]]
    assert [phase.forced_token(), _feed(phase, [END_B], output)] == [END_B, [False]]
    assert phase.answering


def test_optional_without_the_start_token_answers_from_the_first_token():
    phase = _phase(OPTIONAL, budget=0, structured_outputs=GRAMMAR)
    assert _feed(phase, [5]) == [True]  # the answer's first token: the grammar takes it
    assert phase.answering and phase.forced_token() is None and phase.start_token is None


def test_a_copy_goes_on_alone():
    phase = _phase(budget=2)
    _feed(phase, [5])
    twin = phase.copy()
    _feed(twin, [6, NEWLINE])
    assert (phase.num_thought, phase.forced_token()) == (1, None)
    assert (twin.num_thought, twin.forced_token()) == (2, END_A)


# ---- the manager -----------------------------------------------------------------------
def _manager() -> StructuredOutputManager:
    return StructuredOutputManager(lambda: TOKENIZER_JSON, VOCAB_SIZE, [0])


def _admitted(manager: StructuredOutputManager, **params) -> Request:
    request = make_request("r", [1, 2, 3], temperature=1.0, max_tokens=50, **params)
    manager.admit(request)
    if request.grammar is not None:
        request.grammar.future.result(timeout=30)
        assert manager.ready(request)
    return request


def _allowed(masks, row: int = 0) -> list[int]:
    words = np.frombuffer(masks.bitmask, dtype="<u4").reshape(len(masks.request_ids), -1)
    return [t for t in range(VOCAB_SIZE) if (int(words[row][t // 32]) >> (t % 32)) & 1]


def _assert_grammar_row(manager: StructuredOutputManager, masks) -> None:
    """The row is GRAMMAR's ("a+"): every allowed token is a run of "a"."""
    allowed = _allowed(masks)
    assert allowed and all(set(manager.tokenizer().decode_str([t])) == {"a"} for t in allowed)


def _sample(manager: StructuredOutputManager, request: Request, token: int):
    request.append_output_token_ids([token])
    return manager.accept(request, token)


def _masks(manager: StructuredOutputManager, request: Request):
    return manager.masks([request], {request.request_id: 1})


def _decoding(request: Request) -> Request:
    request.num_computed_tokens = request.num_tokens - 1  # its next step samples
    return request


def test_a_thinking_sequence_has_no_row_and_its_tokens_never_reach_the_grammar():
    manager = _manager()
    request = _decoding(_admitted(manager, reasoning=THINK, structured_outputs=GRAMMAR))
    assert _masks(manager, request) is None  # unconstrained while thinking
    bad = manager.tokenizer().tokenize_str("zz")[0]  # a token "a+" refuses
    for token in (bad, END_A, END_B):
        assert _sample(manager, request, token) is None
    assert request.reasoning.answering
    _assert_grammar_row(manager, _masks(manager, _decoding(request)))
    assert _sample(manager, request, bad) == RequestStatus.FINISHED_ERROR  # the answer's


def test_the_forced_end_is_one_token_a_row_and_the_grammar_starts_after_it():
    manager = _manager()
    request = _admitted(manager, reasoning=THINK, structured_outputs=GRAMMAR)
    request.reasoning = _phase(budget=1, structured_outputs=GRAMMAR)
    _sample(manager, request, 5)
    for token in (NEWLINE, END_A, END_B):
        masks = _masks(manager, _decoding(request))
        assert masks.request_ids == ["r"] and _allowed(masks) == [token]
        assert _sample(manager, request, token) is None
    assert request.reasoning.answering
    _assert_grammar_row(manager, _masks(manager, _decoding(request)))


def test_an_optional_first_row_is_the_grammars_plus_the_start_token():
    manager = _manager()
    plain = _decoding(_admitted(manager, structured_outputs=GRAMMAR))
    request = _decoding(_admitted(manager, reasoning=OPTIONAL, structured_outputs=GRAMMAR))
    grammar_row = _allowed(_masks(manager, plain))
    assert _allowed(_masks(manager, request)) == sorted([*grammar_row, START])
    a = grammar_row[0]
    assert _sample(manager, request, a) is None  # the grammar took it: not an error
    assert request.reasoning.answering and request.output_token_ids == [a]


def test_a_grammar_that_allows_only_eos_does_not_end_a_thinking_request():
    manager = _manager()
    only_eos = {"grammar": 'start: ""'}
    thinking = _admitted(manager, reasoning=THINK, structured_outputs=only_eos)
    answering = _admitted(manager, structured_outputs=only_eos)
    assert manager.gate(thinking) is None  # it runs: the answer comes after the thinking
    assert manager.gate(answering) == RequestStatus.FINISHED_STOPPED


def test_no_proposal_is_verified_before_the_answer():
    manager = _manager()
    request = _admitted(manager, reasoning=THINK, thinking_token_budget=8)
    assert manager.valid_prefix(request, [5, 6, 7]) == []
    for token in (END_A, END_B):
        _sample(manager, request, token)
    assert manager.valid_prefix(request, [5, 6, 7]) == [5, 6, 7]


def test_requests_without_bounds_get_no_phase():
    manager = _manager()
    assert _admitted(manager, structured_outputs=GRAMMAR).reasoning is None
    assert _admitted(manager, reasoning=THINK).reasoning is None  # nothing to apply


# ---- the scheduler ---------------------------------------------------------------------
class ForcingWorker(StandInWorker):
    """The stand-in, but a row whose mask allows one token writes that token (as the
    real worker's masked sampling does); other rows ignore their masks."""

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        output = super().execute(plan)
        if not plan.grammar_request_ids:
            return output
        words = np.frombuffer(plan.grammar_bitmask, dtype="<u4")
        words = words.reshape(len(plan.grammar_request_ids), -1)
        for rid, row in zip(plan.grammar_request_ids, words, strict=True):
            allowed = [t for t in range(VOCAB_SIZE) if (int(row[t // 32]) >> (t % 32)) & 1]
            sampled = output.sampled_token_ids[output.request_ids.index(rid)]
            if len(allowed) == 1 and sampled:
                sampled[-1] = self.states[rid].token_ids[-1] = allowed[0]
        return output


def _scheduler(manager=None, **config) -> tuple[Scheduler, ForcingWorker]:
    config.setdefault("max_model_len", 2048)
    scheduler = Scheduler(
        SchedulerConfig(**config),
        CacheConfig(block_size=4),
        num_device_blocks=64,
        structured=manager or StructuredOutputManager(None, VOCAB_SIZE),
    )
    return scheduler, ForcingWorker(64, 4, 0)


def _run(scheduler: Scheduler, worker: StandInWorker, until=None) -> None:
    for _ in range(200):
        if not scheduler.has_unfinished_requests() or (until and until()):
            return
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, worker.execute(plan))
    raise AssertionError("the requests did not finish")


def test_the_engine_thinks_n_tokens_then_writes_the_forced_end():
    scheduler, worker = _scheduler()
    prompt = [5, 6, 7, 8, 9]
    free = reference_generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True), 2048)
    request = make_request(
        "r", prompt, max_tokens=12, ignore_eos=True, reasoning=THINK, thinking_token_budget=6
    )
    scheduler.add_request(request)
    _run(scheduler, worker)
    assert request.output_token_ids[:6] == free  # the thinking is the model's own
    assert request.output_token_ids[6:9] == [NEWLINE, END_A, END_B]
    assert len(request.output_token_ids) == 12


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_phase_survives_preemption(mode):
    worker = ForcingWorker(64, 4, 16)
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=2048, preemption_mode=mode),
        CacheConfig(block_size=4),
        num_device_blocks=64,
        num_cpu_blocks=16,
        structured=StructuredOutputManager(None, VOCAB_SIZE),
    )
    request = make_request(
        "r", [5, 6, 7], max_tokens=10, ignore_eos=True, reasoning=THINK, thinking_token_budget=4
    )
    scheduler.add_request(request)
    _run(scheduler, worker, until=lambda: request.num_output_tokens == 3)
    scheduler._preempt(request)
    _run(scheduler, worker)
    assert scheduler.num_preemptions == 1
    assert request.output_token_ids[4:7] == [NEWLINE, END_A, END_B]
    assert request.reasoning.answering


def test_n_2_sequences_each_force_their_own_end():
    scheduler, worker = _scheduler()
    request = make_request(
        "g",
        [5, 6, 7],
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=8,
        ignore_eos=True,
        reasoning=THINK,
        thinking_token_budget=2,
    )
    scheduler.add_request(request)
    _run(scheduler, worker, until=lambda: "g#1" in scheduler.requests)
    child = scheduler.requests["g#1"]
    assert child.reasoning is not request.reasoning
    _run(scheduler, worker)
    for sequence in (request, child):
        assert sequence.output_token_ids[2:5] == [NEWLINE, END_A, END_B]
    assert request.output_token_ids[:2] != child.output_token_ids[:2]  # their own seeds


def test_proposals_are_verified_only_after_the_thinking():
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=2048),
        CacheConfig(block_size=4),
        num_device_blocks=64,
        structured=StructuredOutputManager(None, VOCAB_SIZE),
    )
    worker = ForcingWorker(64, 4, 0, proposer=accurate(3))
    request = make_request(
        "r", [5, 6, 7], max_tokens=20, ignore_eos=True, reasoning=THINK, thinking_token_budget=3
    )
    scheduler.add_request(request)
    _run(scheduler, worker)
    verified = [len(p.scheduled_spec_decode_tokens.get("r", [])) for p in worker.plans]
    thinking_steps = 3 + 3  # the prefill and two decodes write 3 thinking tokens; the end 3
    assert verified[:thinking_steps] == [0] * thinking_steps
    assert verified[thinking_steps] == 3  # the first step of the answer verifies
    assert request.output_token_ids[3:6] == [NEWLINE, END_A, END_B]


def test_bounds_outside_the_vocabulary_are_refused_at_admission():
    scheduler, _ = _scheduler()
    bounds = ReasoningBounds(ReasoningMode.THINKING, (), (VOCAB_SIZE,), (VOCAB_SIZE,))
    request = make_request("r", [1, 2], reasoning=bounds, thinking_token_budget=1)
    with pytest.raises(RequestRejectedError, match=r"reasoning.end_token_ids contains token id"):
        scheduler.add_request(request)


def test_a_budget_needs_an_engine_that_knows_its_vocabulary():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(), num_device_blocks=8)
    request = make_request("r", [1, 2], reasoning=THINK, thinking_token_budget=1)
    with pytest.raises(RequestRejectedError, match="vocabulary size"):
        scheduler.add_request(request)


@pytest.mark.parametrize(
    "bounds", [None, ReasoningBounds(ReasoningMode.THINKING, (), (END_A,), ())]
)
def test_a_budget_set_after_construction_is_checked_at_admission(bounds):
    """Frontends fill the budget and the bounds in after SamplingParams checked itself."""
    scheduler, _ = _scheduler()
    request = make_request("r", [1, 2])
    request.sampling_params.thinking_token_budget = 4
    request.sampling_params.reasoning = bounds
    with pytest.raises(RequestRejectedError, match="thinking_token_budget needs"):
        scheduler.add_request(request)
