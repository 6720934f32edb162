"""The stand-in worker with speculative decoding: it verifies the plan's proposals as the
real worker does (the target's token at every verified position, the accepted prefix plus
one) and proposes what its `proposer` says after every step.

The target's fake KV cache is checked exactly as in stand_in_worker.py: before a request
samples, every position of its context (its known tokens, then the proposals it verifies)
must be read back from its block table. With `lookahead` > 0 it also plays the draft
model: a second fake cache in the same block tables, caught up over the positions the
target computed this step (+1) and written at the proposals' positions, which must lie
inside the table (the scheduler's lookahead slots). Before the draft "proposes" it reads
its own context back, so a draft cache lost in a swap, a copy-on-write or a shared block
fails loudly too. Tokens come from stand_in_worker.next_token, so outputs are compared
with reference_generate whatever was proposed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from tests.scheduler.stand_in_worker import VOCAB_SIZE, StandInWorker, next_token, top_logprobs

# (request_id, token_ids, seed, room) -> proposals (at most room of them)
Proposer = Callable[[str, list[int], "int | None", int], list[int]]


def true_continuation(token_ids: list[int], seed: int | None, count: int) -> list[int]:
    """The next `count` tokens the stand-in model will produce (proposals all accepted)."""
    tokens = list(token_ids)
    for _ in range(count):
        tokens.append(next_token(tokens, seed))
    return tokens[len(token_ids) :]


def wrong_token(token_ids: list[int], seed: int | None) -> int:
    """A token the stand-in model will not produce next (a proposal surely rejected)."""
    return (next_token(token_ids, seed) + 1) % VOCAB_SIZE


def accurate(k: int) -> Proposer:
    return lambda rid, tokens, seed, room: true_continuation(tokens, seed, min(k, room))


def wrong(k: int) -> Proposer:
    def propose(rid, tokens, seed, room):
        return [wrong_token(tokens, seed)] * min(k, room)

    return propose


def random_proposer(k: int, rng: random.Random, accuracy: float) -> Proposer:
    """Up to k proposals: each follows the true continuation with probability `accuracy`
    (so runs of accepted proposals of every length occur), else a random token."""

    def propose(rid, tokens, seed, room):
        count = rng.randint(0, min(k, room))
        context, out = list(tokens), []
        for _ in range(count):
            token = next_token(context, seed)
            if rng.random() >= accuracy:
                token = rng.randrange(VOCAB_SIZE)
            out.append(token)
            context.append(token)
        return out

    return propose


@dataclass
class SpecStandInWorker(StandInWorker):
    proposer: Proposer | None = None
    max_model_len: int = 2048
    lookahead: int = 0  # > 0: play the draft model and its cache
    beams: set[str] = field(default_factory=set)  # beam search sequences: no proposals

    def __post_init__(self) -> None:
        super().__post_init__()
        self.draft_kv: list[tuple[int, int] | None] = [None] * len(self.kv)
        self.draft_cpu_kv: list[tuple[int, int] | None] = [None] * len(self.cpu_kv)

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        super()._move_blocks(plan)  # the target's cache
        for device_block, cpu_block in plan.blocks_to_swap_out:  # the draft's, the same way
            self._copy(self.draft_kv, device_block, self.draft_cpu_kv, cpu_block)
        for cpu_block, device_block in plan.blocks_to_swap_in:
            self._copy(self.draft_cpu_kv, cpu_block, self.draft_kv, device_block)
        for src, dst in plan.blocks_to_copy:
            self._copy(self.draft_kv, src, self.draft_kv, dst)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.plans.append(plan)
        self._move_blocks(plan)
        self._apply_diffs(plan)
        self.beams |= {
            n.request_id for n in plan.scheduled_new_reqs if n.sampling_params.use_beam_search
        }
        request_ids, sampled, logprobs, proposals = [], [], {}, {}
        for rid, num_tokens in plan.num_scheduled_tokens.items():
            state = self.states[rid]
            start = state.num_computed_tokens
            drafts = plan.scheduled_spec_decode_tokens.get(rid, [])
            known = len(state.token_ids)
            tokens = self._verify(rid, num_tokens, drafts)
            request_ids.append(rid)
            sampled.append(tokens)
            if tokens and state.logprobs is not None:
                logprobs[rid] = [
                    top_logprobs(state.token_ids[: known + i], state.seed, state.logprobs)
                    for i in range(len(tokens))
                ]
            if self.lookahead:
                self._draft_catch_up(rid, start, num_tokens)
            if tokens and self.proposer is not None and rid not in self.beams:
                room = max(self.max_model_len - len(state.token_ids) - 1, 0)
                props = self.proposer(rid, list(state.token_ids), state.seed, room)
                assert len(props) <= room, (rid, props, room)
                props = self._draft_write(rid, props) if self.lookahead else props
                if props:
                    proposals[rid] = props
        return RunnerOutput(
            request_ids=request_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            spec_token_ids=proposals,
        )

    def _verify(self, rid: str, num_tokens: int, drafts: list[int]) -> list[int]:
        state = self.states[rid]
        known = len(state.token_ids)
        context = state.token_ids + list(drafts)
        start = state.num_computed_tokens
        end = start + num_tokens
        assert end <= len(context), f"{rid}: scheduled past the known tokens and proposals"
        assert not drafts or end == len(context), f"{rid}: proposals not all scheduled"
        for pos in range(start, end):
            self.kv[self._slot(state, pos)] = (context[pos], pos)
        if end < len(context):
            state.num_computed_tokens = end
            return []  # a middle chunk of a prefill: nothing to sample
        for pos in range(end):  # "attention" over the context, proposals included
            cell = self.kv[self._slot(state, pos)]
            assert cell == (context[pos], pos), f"{rid}: KV slot {pos} holds {cell}"
        out = []
        for i in range(len(drafts) + 1):  # the target's token at every verified position
            token = next_token(context[: known + i], state.seed)
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                break
        state.token_ids += out
        state.num_computed_tokens = len(state.token_ids) - 1  # rejected positions roll back
        return out

    def _draft_catch_up(self, rid: str, start: int, count: int) -> None:
        """The draft's forward over what the target computed this step, +1 (as
        DraftModelProposer: up to the last known token, within the table)."""
        state = self.states[rid]
        num_slots = len(state.block_ids) * self.block_size
        end = min(len(state.token_ids), start + count + 1, num_slots)
        for pos in range(start, end):
            self.draft_kv[self._slot(state, pos)] = (state.token_ids[pos], pos)

    def _draft_write(self, rid: str, props: list[int]) -> list[int]:
        """The draft reads its context back, then writes each proposal but the last at
        its position (while making the next), never past the table: fewer proposals then."""
        state = self.states[rid]
        num_tokens = len(state.token_ids)
        num_slots = len(state.block_ids) * self.block_size
        if num_tokens > num_slots:
            return []
        for pos in range(num_tokens):
            cell = self.draft_kv[self._slot(state, pos)]
            assert cell == (state.token_ids[pos], pos), f"{rid}: draft KV slot {pos} holds {cell}"
        kept = props[: max(num_slots - num_tokens + 1, 0)]
        for i, token in enumerate(kept[:-1]):
            self.draft_kv[self._slot(state, num_tokens + i)] = (token, num_tokens + i)
        return kept
