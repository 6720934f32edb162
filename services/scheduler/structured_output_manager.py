"""StructuredOutputManager: grammars for constrained requests, compiled here with llguidance.

A grammar compiles on a worker thread (never the step thread), cached by the sha256 of the
normalised grammar; its request waits in the queue while others run past it. Every
sequence has its own matcher, so its state survives preemption (its tokens are never
rolled back). llguidance is torch-free, which is why this lives in the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from services.scheduler.reasoning_phase import ReasoningPhase
from services.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0
CACHE_SIZE = 256  # compiled grammars kept (pristine matchers to copy)


class GrammarError(ValueError):
    """The request's grammar cannot be used (it failed to compile, or took too long)."""


@dataclass(eq=False)
class GrammarState:
    key: str
    future: Future  # -> a pristine LLMatcher
    deadline: float
    matcher: object | None = None  # this sequence's own LLMatcher, once compiled


@dataclass(frozen=True)
class StepMasks:
    request_ids: list[str]
    bitmask: bytes  # int32 little-endian [len(request_ids), ceil(vocab / 32)]


class StructuredOutputManager:
    """A compile fails past `compile_timeout_s` (llguidance bounds each compile's work
    itself). Each step fills one packed int32 bitmask row [ceil(vocab / 32)] per sampling
    row with a grammar, and `accept` advances the sequence's matcher: a rejected token ends
    the request with an error, a grammar that allows only EOS ends it with "stop".

    A reasoning sequence's grammar waits for its ReasoningPhase (reasoning_phase.py) to
    answer: until then no mask, no accept and no verified proposal; a forced end marker goes
    through the same bitmask.
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str] | None,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        """`tokenizer_json` returns the model's tokenizer.json text (None: no tokenizer,
        constrained requests are refused)."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.words = (vocab_size + 31) // 32
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future] = OrderedDict()

    # ---- admission and compilation -----------------------------------------------------
    def admit(self, request: Request) -> None:
        """Start compiling the request's grammar (ValueError when it cannot be served)."""
        if request.is_pooling:
            return
        self._admit_reasoning(request)
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return
        if self._tokenizer_json is None:
            raise ValueError(
                "structured_outputs needs the model's tokenizer (tokenizer.json), which "
                "this engine does not have."
            )
        key = constraint.grammar_key
        future = self._cache.get(key)
        if future is None:
            future = self._executor().submit(self._compile, constraint.grammar_text)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        deadline = time.monotonic() + self.compile_timeout_s
        request.grammar = GrammarState(key, future, deadline)

    def _admit_reasoning(self, request: Request) -> None:
        params = request.sampling_params
        if params.thinking_token_budget is not None:
            params.verify_thinking_budget()
        bounds = params.reasoning
        if bounds is None:
            return
        if self.vocab_size:
            bounds.check_vocab(self.vocab_size)
        phase = ReasoningPhase.for_params(params)
        if phase is not None and not self.vocab_size:
            raise ValueError(
                "thinking_token_budget needs the model's vocabulary size, which this "
                "engine does not have."
            )
        request.reasoning = phase

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="pagestream-grammar")
        return self._pool

    def _compile(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def tokenizer(self):
        """llguidance's view of the model's tokenizer (built once, ~1 s)."""
        with self._tokenizer_lock:
            return self._build_tokenizer()

    def _build_tokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            eos = self.eos_token_ids or None
            self._tokenizer = LLTokenizer(
                self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=eos
            )
        return self._tokenizer

    def ready(self, request: Request) -> bool:
        """Whether the request may run; raises GrammarError when its grammar failed."""
        state: GrammarState | None = request.grammar
        if state is None or state.matcher is not None:
            return True
        if not state.future.done():
            if time.monotonic() > state.deadline:
                self._cache.pop(state.key, None)
                raise GrammarError(
                    f"the grammar did not compile within {self.compile_timeout_s:.0f}s."
                )
            return False
        error = state.future.exception()
        if error is not None:
            self._cache.pop(state.key, None)
            raise GrammarError(str(error)) from error
        state.matcher = state.future.result().deep_copy()
        return True

    def exhausted(self, request: Request) -> bool:
        """The grammar allows nothing but EOS (an empty output, or the end reached): the
        request is complete. Checked when it is about to run, so it ends at once."""
        state: GrammarState | None = request.grammar
        if state is None or state.matcher is None or _thinking(request):
            return False  # a thinking sequence has not started its answer
        if state.matcher.is_stopped():
            return True
        from llguidance.numpy import fill_next_token_bitmask

        row = np.zeros((1, self.words), dtype=np.int32)
        fill_next_token_bitmask(state.matcher, row, 0)
        return not np.any(row[0] & ~self._eos_words())

    def _eos_words(self) -> np.ndarray:
        words = np.zeros(self.words, dtype=np.int64)
        for token in self.eos_token_ids:
            if 0 <= token < self.vocab_size:
                words[token // 32] |= 1 << (token % 32)
        return words.astype(np.uint32).view(np.int32)

    # ---- per step ------------------------------------------------------------------------
    def gate(self, request: Request) -> RequestStatus | None:
        """None when a waiting request may run; WAITING while its grammar compiles; a
        finished status when its grammar failed (request.error says why) or allows nothing
        but EOS from the start (it ends at once, empty)."""
        try:
            if not self.ready(request):
                return RequestStatus.WAITING
        except GrammarError as exc:
            request.error = str(exc)
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if self.exhausted(request) else None

    def masks(
        self,
        scheduled: Sequence[Request],
        num_tokens: dict[str, int],
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> StepMasks | None:
        """Bitmask rows for this step's requests that have a grammar and sample (their
        scheduled tokens reach the end of what they know: no partial prefill chunk). A
        request verifying proposals gets one row per verified position: the matcher is
        advanced over the proposals to fill them, then rolled back (it only ever keeps
        the tokens `accept` is given). A thinking sequence gets a row only to force its
        end (one allowed token) or, before an OPTIONAL first token, the grammar's row
        plus the start token."""
        spec_token_ids = spec_token_ids or {}
        rows = [
            r
            for r in scheduled
            if (r.grammar is not None or r.reasoning is not None)
            and r.num_computed_tokens + num_tokens[r.request_id] >= r.num_tokens
        ]
        if not rows:
            return None
        num_rows = sum(1 + len(spec_token_ids.get(r.request_id, ())) for r in rows)
        bitmask = np.zeros((num_rows, self.words), dtype=np.int32)
        request_ids: list[str] = []
        for request in rows:
            if _thinking(request):
                self._fill_thinking_row(request, bitmask, request_ids)
            elif request.grammar is not None:
                drafts = spec_token_ids.get(request.request_id, [])
                self._fill_grammar_rows(request, drafts, bitmask, request_ids)
        if not request_ids:
            return None
        used = bitmask[: len(request_ids)]
        return StepMasks(request_ids, used.astype("<i4").tobytes())

    @staticmethod
    def _fill_grammar_rows(
        request: Request, drafts: list[int], bitmask: np.ndarray, request_ids: list[str]
    ) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        matcher = request.grammar.matcher
        for position in range(len(drafts) + 1):
            fill_next_token_bitmask(matcher, bitmask, len(request_ids))
            request_ids.append(request.request_id)
            if position < len(drafts):
                matcher.consume_token(drafts[position])
        if drafts:
            matcher.rollback(len(drafts))

    @staticmethod
    def _fill_thinking_row(request: Request, bitmask: np.ndarray, request_ids: list[str]) -> None:
        """Its row, if it needs one: a thinking sequence samples freely otherwise."""
        phase: ReasoningPhase = request.reasoning
        row = len(request_ids)
        if (forced := phase.forced_token()) is not None:
            _allow(bitmask, row, forced)
        elif phase.start_token is not None and request.grammar is not None:
            from llguidance.numpy import fill_next_token_bitmask

            fill_next_token_bitmask(request.grammar.matcher, bitmask, row)
            _allow(bitmask, row, phase.start_token)
        else:
            return
        request_ids.append(request.request_id)

    def valid_prefix(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of the proposals the request's grammar allows (all of them
        without a grammar): no verified position may follow a token the grammar refuses.
        None of them while the sequence is not answering yet: whether each proposal is
        thinking, the end marker or the grammar's depends on the ones before it."""
        if _thinking(request):
            return []
        state: GrammarState | None = request.grammar
        if state is None or state.matcher is None:
            return drafts
        return drafts[: state.matcher.validate_tokens(drafts)]

    def accept(self, request: Request, token_id: int) -> RequestStatus | None:
        """Advance the sequence's phase and, for a token of the answer, its matcher;
        the status it ends in, if any."""
        phase: ReasoningPhase | None = request.reasoning
        if phase is not None and not phase.advance(token_id, request.output_token_ids):
            return None  # thinking: the grammar has not started
        state: GrammarState | None = request.grammar
        if state is None or state.matcher is None:
            return None
        matcher = state.matcher
        if not matcher.consume_token(token_id) or matcher.is_error():
            request.error = (
                f"the sampled token {token_id} is not allowed by the request's grammar "
                f"({matcher.get_error() or 'rejected'})"
            )
            request.error_code = "internal"
            return RequestStatus.FINISHED_ERROR
        if matcher.is_stopped():
            return RequestStatus.FINISHED_STOPPED
        return None

    def fork(self, parent: Request, child: Request) -> None:
        """An n > 1 sequence continues from its parent's grammar state and reasoning
        phase, with its own copies."""
        if parent.reasoning is not None:
            child.reasoning = parent.reasoning.copy()
        state: GrammarState | None = parent.grammar
        if state is None:
            return
        matcher = state.matcher.deep_copy() if state.matcher is not None else None
        child.grammar = GrammarState(state.key, state.future, state.deadline, matcher)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _thinking(request: Request) -> bool:
    """The sequence has a reasoning phase that has not reached the answer."""
    return request.reasoning is not None and not request.reasoning.answering


def _allow(bitmask: np.ndarray, row: int, token_id: int) -> None:
    """Set token_id's bit in a packed row (bit t % 32 of word t // 32)."""
    bitmask.view(np.uint32)[row, token_id // 32] |= np.uint32(1 << (token_id % 32))


def tokenizer_json_of(model: str) -> Callable[[], str]:
    """Reads the model's tokenizer.json on first use (the model folder is resolved then, so
    a scheduler that never sees a constrained request never looks for it)."""

    def read() -> str:
        from pathlib import Path

        from services.common.model_source import resolve_model

        path = Path(resolve_model(model)) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(
                f"structured outputs need the model's tokenizer.json (a fast tokenizer); "
                f"{path} does not exist."
            )
        return path.read_text(encoding="utf-8")

    return read
