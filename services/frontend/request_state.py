"""RequestState: the frontend's view of one client request and its n sequences."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.engine_output import EngineCoreOutput
from services.common.outputs import CompletionOutput, Logprob, RequestOutput
from services.common.runner_output import TokenLogprobs
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.detokenizer import IncrementalDetokenizer, NullDetokenizer, make_detokenizer


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer | NullDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for delta outputs
    num_sent_logprobs: int = 0
    text_sent: str = ""
    pending_text: str = ""  # released by the detokenizer, not yet handed to the client


def to_logprob_dicts(entries: list[TokenLogprobs | None], tokenizer) -> list:
    def convert(entry: TokenLogprobs | None):
        if entry is None:
            return None
        return {
            tid: Logprob(lp, rank, tokenizer.decode([tid]) if tokenizer else None)
            for tid, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True)
        }

    return [convert(e) for e in entries]


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0
        self.queued_s: float | None = None  # arrival to first scheduling, from the engine
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
        self._prompt_pass_pos = 0  # prompt positions the engine's current scoring pass covered
        self.sequences: dict[int, SequenceState] = {}

    def _add_prompt_logprobs(self, entries: list) -> None:
        """Entries continue the engine's scoring pass; a pass that starts over (position 0,
        whose entry is None) is a recompute after preemption: positions already kept are
        skipped, so each position is kept once, from its first pass."""
        if entries and entries[0] is None:
            self._prompt_pass_pos = 0
        start = self._prompt_pass_pos
        self._prompt_pass_pos += len(entries)
        kept = len(self.prompt_logprobs)
        new = entries[max(kept - start, 0) : len(self.prompt_token_ids) - start]
        self.prompt_logprobs.extend(to_logprob_dicts(new, self.tokenizer))

    def _sequence(self, index: int) -> SequenceState:
        if index not in self.sequences:
            detok = make_detokenizer(self.tokenizer, self.prompt_token_ids, self.params)
            self.sequences[index] = SequenceState(
                index, detok, logprobs=[] if self.params.logprobs is not None else None
            )
        return self.sequences[index]

    @property
    def finished(self) -> bool:
        seqs = self.sequences.values()
        return len(self.sequences) == self.params.n and all(s.finish_reason for s in seqs)

    def process(self, out: EngineCoreOutput) -> str | None:
        """Apply one engine output; returns a sequence id to abort when a stop string hit."""
        seq = self._sequence(out.index)
        if seq.finish_reason is not None:
            return None  # ended by a stop string; the engine's late outputs are dropped
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.queued_s is not None and self.queued_s is None:
            self.queued_s = out.queued_s
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self._add_prompt_logprobs(out.new_prompt_logprobs)
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        text_ids = out.new_token_ids
        if self._stop_terminated(out):  # as vLLM: the EOS / stop token adds no text
            text_ids = text_ids[:-1]
        update = seq.detokenizer.update(text_ids, finished=out.finished)
        kept = update.num_tokens_kept  # a stop string inside several new tokens ends there
        seq.token_ids.extend(out.new_token_ids[:kept])
        self._add_logprobs(seq, out.new_logprobs[:kept] if out.new_logprobs else None)
        if out.cumulative_logprob is not None:  # beam search reports its beam's score
            seq.cumulative_logprob = out.cumulative_logprob
        seq.pending_text += update.text_delta
        if update.stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", update.stop_string
            return None if out.finished else out.request_id
        if out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            if out.parent_request_id is None and self.params.n > 1:
                self._finish_unforked(out.finish_reason)
        return None

    def _stop_terminated(self, out) -> bool:
        """The output ends on the token that stopped it (EOS or a stop token id), whose text
        never shows, even with skip_special_tokens off (tool parsers turn it off)."""
        if not out.finished or out.finish_reason != "stop" or not out.new_token_ids:
            return False
        if self.params.include_stop_str_in_output:
            return False
        last = out.new_token_ids[-1]
        if isinstance(out.stop_reason, int):
            return out.stop_reason == last
        special = getattr(self.tokenizer, "all_special_ids", None) or ()
        return out.stop_reason is None and last in special

    def _finish_unforked(self, reason: str | None) -> None:
        """An n > 1 group that ended before it forked: its other sequences end with it."""
        for index in range(self.params.n):
            other = self._sequence(index)
            if other.finish_reason is None:
                other.finish_reason = reason

    def _add_logprobs(self, seq: SequenceState, entries: list[TokenLogprobs] | None) -> None:
        if seq.logprobs is None or not entries:
            return
        seq.logprobs.extend(to_logprob_dicts(entries, self.tokenizer))
        chosen = sum(e.logprobs[0] for e in entries)
        seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + chosen

    def make_output(self) -> RequestOutput | None:
        """The output to hand out now, by output_kind; None when there is nothing to say."""
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outputs = [self._completion(s, delta) for _, s in sorted(self.sequences.items())]
        if delta and not finished and not any(o.token_ids or o.text for o in outputs):
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics={} if self.queued_s is None else {"time_in_queue": self.queued_s},
        )

    def _completion(self, seq: SequenceState, delta: bool) -> CompletionOutput:
        seq.text_sent += seq.pending_text
        new_text, seq.pending_text = seq.pending_text, ""
        if delta:
            token_ids = seq.token_ids[seq.num_sent_tokens :]
            logprobs = seq.logprobs[seq.num_sent_logprobs :] if seq.logprobs is not None else None
        else:
            token_ids, logprobs, new_text = list(seq.token_ids), seq.logprobs, seq.text_sent
        seq.num_sent_tokens = len(seq.token_ids)
        seq.num_sent_logprobs = len(seq.logprobs or [])
        return CompletionOutput(
            index=seq.index,
            text=new_text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
