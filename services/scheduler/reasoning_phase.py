"""ReasoningPhase: where one sequence's output stands against its thinking.

    OPTIONAL --first token is the start--> THINKING --end marker seen--> ANSWER
        \\--any other first token: it is the answer's first--------------^
    THINKING --budget spent--> forcing forced_end_token_ids, one a step --> ANSWER

A function of the output tokens alone, so it survives preemption and an n > 1 fork copies
it; the structured-output manager consults it (ReasoningPhase says how).
"""

from __future__ import annotations

from services.common.reasoning_bounds import ReasoningBounds, ReasoningMode
from services.common.sampling_params import SamplingParams

_UNDECIDED = 0  # OPTIONAL before the first output token
_THINKING = 1
_ANSWER = 2


class ReasoningPhase:
    """A sequence whose params carry ReasoningBounds (and a grammar or a thinking budget, the two
    things the engine does with them) gets a phase at admission. The phase is a function of
    the output tokens alone, advanced once per appended token (`advance`), so it survives
    preemption in both modes (output tokens are never rolled back) and an n > 1 fork copies
    it. The structured-output manager consults it: no grammar mask and no grammar `accept`
    until the phase answers, a one-token mask row while the budget forces the end marker,
    and no speculative proposals verified before the answer.
    """

    __slots__ = ("_bounds", "_budget", "_num_forced", "_num_thought", "_state")

    def __init__(self, bounds: ReasoningBounds, budget: int | None) -> None:
        self._bounds = bounds
        self._budget = budget
        self._state = _UNDECIDED if bounds.mode == ReasoningMode.OPTIONAL else _THINKING
        self._num_thought = 0  # thinking tokens so far, the start token not counted
        self._num_forced = 0  # forced end tokens written so far

    @classmethod
    def for_params(cls, params: SamplingParams) -> ReasoningPhase | None:
        """The phase a new sequence starts in; None when the engine has nothing to do
        with its bounds (none, no grammar and no budget, or the answer from the start),
        which keeps such sequences free of per-token work."""
        bounds = params.reasoning
        if bounds is None or bounds.mode == ReasoningMode.ANSWER:
            return None
        if params.structured_outputs is None and params.thinking_token_budget is None:
            return None
        if bounds.mode == ReasoningMode.OPTIONAL and len(bounds.start_token_ids) != 1:
            # Deciding on a multi-token start would take several steps of masks (the
            # grammar's or the start's next token), so OPTIONAL acts only on a one-token
            # start; with a longer one the output is taken as the answer from its first
            # token, as in ANSWER.
            return None
        return cls(bounds, params.thinking_token_budget)

    def copy(self) -> ReasoningPhase:
        """An independent phase in the same place (an n > 1 fork)."""
        twin = ReasoningPhase(self._bounds, self._budget)
        twin._state, twin._num_thought = self._state, self._num_thought
        twin._num_forced = self._num_forced
        return twin

    @property
    def answering(self) -> bool:
        """The output is the answer now: a grammar applies from the next token."""
        return self._state == _ANSWER

    @property
    def start_token(self) -> int | None:
        """The token that opens the thinking, while the first output token may still be
        it (OPTIONAL before the first token); None otherwise."""
        return self._bounds.start_token_ids[0] if self._state == _UNDECIDED else None

    @property
    def num_thought(self) -> int:
        return self._num_thought

    def forced_token(self) -> int | None:
        """The token the next step must write: once the budget is spent while thinking,
        forced_end_token_ids one by one; None when the model samples freely."""
        if self._state != _THINKING or self._budget is None or self._num_thought < self._budget:
            return None
        return self._bounds.forced_end_token_ids[self._num_forced]

    def advance(self, token_id: int, output_token_ids: list[int]) -> bool:
        """Take the newest output token (`output_token_ids` ends with it); True when it
        is the answer's (a grammar consumes it), False for the thinking, its markers and
        the forced end."""
        if self._state == _ANSWER:
            return True
        if self._state == _UNDECIDED:
            self._state = _THINKING if token_id == self._bounds.start_token_ids[0] else _ANSWER
            return self._state == _ANSWER
        if self.forced_token() is not None:
            # The mask allowed this one token; the end marker inside the forced ids does
            # not end the phase early, so the whitespace after it is forced too.
            self._num_forced += 1
            if self._num_forced == len(self._bounds.forced_end_token_ids):
                self._state = _ANSWER
            return False
        self._num_thought += 1
        if self._ends_thinking(token_id, output_token_ids):
            self._state = _ANSWER
        return False

    def _ends_thinking(self, token_id: int, output_token_ids: list[int]) -> bool:
        end = self._bounds.end_token_ids
        if token_id != end[-1] or len(output_token_ids) < len(end):
            return False
        return len(end) == 1 or tuple(output_token_ids[-len(end) :]) == end
