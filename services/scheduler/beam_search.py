"""BeamGroup: beam search bookkeeping for one request, pure Python.

Each live beam is a Request on the paged cache; the worker returns the top-K logprobs of
each beam's next token (K = max(2, 1 + number of EOS ids) * beam_width). Once every live
beam has reported, `advance` picks the next beams exactly as HF transformers'
`generate(num_beams=k, do_sample=False)` does. The scheduler forks the next beams from
their parents' blocks (shared, copy-on-write on the partial block) and frees the pruned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.runner_output import TokenLogprobs


def length_normalized(logprob: float, length: int, length_penalty: float) -> float:
    """logprob / length ** length_penalty, without overflow for extreme penalties."""
    log_denominator = length_penalty * math.log(length)
    if log_denominator > 700.0:  # the denominator overflows a float: the score goes to -0
        return -0.0 if logprob < 0 else 0.0
    if log_denominator < -700.0:  # the denominator underflows to 0: the score goes to -inf
        return -math.inf if logprob < 0 else 0.0
    return logprob / length**length_penalty


@dataclass(frozen=True)
class BeamHypothesis:
    token_ids: list[int]  # generated tokens (the EOS included when it ended the beam)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    ended_with_eos: bool


@dataclass(frozen=True)
class NextBeam:
    parent_id: str
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True)
class BeamStep:
    next_beams: list[NextBeam]
    done: bool


@dataclass
class BeamGroup:
    group_id: str
    beam_width: int
    max_tokens: int
    length_penalty: float
    eos_token_ids: frozenset[int]
    client_id: int = 0
    live: dict[str, float] = field(default_factory=dict)  # beam id -> cumulative logprob
    reports: dict[str, TokenLogprobs] = field(default_factory=dict)
    finished: list[BeamHypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    num_steps: int = 0

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width

    def start(self, root_id: str) -> None:
        self.live = {root_id: 0.0}
        self.reports = {}

    def report(self, beam_id: str, entry: TokenLogprobs) -> bool:
        """Record a beam's next-token logprobs; True once every live beam has reported."""
        if beam_id in self.live:
            self.reports[beam_id] = entry
        return len(self.reports) == len(self.live)

    def advance(self, outputs: dict[str, list[int]]) -> BeamStep:
        """One beam-search step; outputs maps each live beam to its generated tokens so far.
        As HF (early_stopping=False, length_penalty):

        - candidates: beam score + token logprob over all beams, the best K kept, in order;
        - a candidate that ends with EOS or reaches max_tokens is "done"; done candidates
          among the first beam_width are finalized with score / generated_len **
          length_penalty (while an improvement is still possible), keeping the best
          beam_width finished hypotheses;
        - the best beam_width candidates that are not done become the next beams;
        - search stops when every candidate is done, or when the finished set is full and
          the best running beam, normalised at the current length, cannot beat its worst.
        """
        generated_len = len(next(iter(outputs.values()))) + 1
        candidates = self._top_candidates()
        done_flags = [self._is_done(token_id, generated_len) for _, _, token_id in candidates]
        next_beams = [
            NextBeam(beam_id, token_id, score)
            for (score, beam_id, token_id), done in zip(candidates, done_flags, strict=True)
            if not done
        ][: self.beam_width]
        self._finalize(candidates, done_flags, outputs, generated_len)
        self._update_improvement(next_beams, generated_len)
        self.num_steps += 1
        self.reports = {}
        stop = all(done_flags) or not self.improvement_possible or not next_beams
        return BeamStep(next_beams=[] if stop else next_beams, done=stop)

    def _top_candidates(self) -> list[tuple[float, str, int]]:
        candidates = []
        for order, (beam_id, base) in enumerate(self.live.items()):
            entry = self.reports[beam_id]
            # Entry 0 is the sampled (greedy) token, repeated among the top ones.
            for token_id, logprob in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True):
                candidates.append((base + logprob, order, token_id, beam_id))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        return [(score, beam_id, tok) for score, _, tok, beam_id in candidates][
            : self.num_candidates
        ]

    def _is_done(self, token_id: int, generated_len: int) -> bool:
        return token_id in self.eos_token_ids or generated_len >= self.max_tokens

    def _finalize(self, candidates, done_flags, outputs, generated_len: int) -> None:
        if not self.improvement_possible:
            return
        for (score, beam_id, token_id), done in zip(
            candidates[: self.beam_width], done_flags[: self.beam_width], strict=True
        ):
            if done:
                self.finished.append(
                    BeamHypothesis(
                        token_ids=[*outputs[beam_id], token_id],
                        cumulative_logprob=score,
                        score=length_normalized(score, generated_len, self.length_penalty),
                        ended_with_eos=token_id in self.eos_token_ids,
                    )
                )
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.beam_width :]

    def _update_improvement(self, next_beams: list[NextBeam], generated_len: int) -> None:
        if len(self.finished) < self.beam_width or not next_beams:
            return
        best_running = length_normalized(
            next_beams[0].cumulative_logprob, generated_len, self.length_penalty
        )
        if best_running <= self.finished[-1].score:
            self.improvement_possible = False
