"""A deterministic, torch-free stand-in for the worker.

It follows the plan's diff protocol exactly as the real worker must (new requests in
full, deltas for the rest, finished ids dropped) and keeps a fake paged KV cache in
which every slot records the (token, position) written there. Before it "samples", it
reads the whole context back through the block table and checks every slot, so a
wrong block table, a missed copy-on-write or a lost swap fails loudly. The next token
is a pure function of the sequence so far (and the seed), so outputs can be compared
with a plain reference loop. When a request asks for logprobs (beam search does), it also
returns a deterministic top-k list led by that token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from services.common.runner_output import RunnerOutput, TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

VOCAB_SIZE = 1000
EOS_TOKEN_ID = 0


def _hash(*key) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def next_token(token_ids: list[int], seed: int | None) -> int:
    """The stand-in model: a hash of the sequence so far (never EOS unless by chance)."""
    return _hash(seed, token_ids) % VOCAB_SIZE


def top_logprobs(token_ids: list[int], seed: int | None, k: int) -> TokenLogprobs:
    """The sampled token, then the top k (next_token first), with falling logprobs."""
    top: list[int] = [next_token(token_ids, seed)]
    salt = 0
    while len(top) < max(k, 1):
        salt += 1
        candidate = _hash(seed, token_ids, salt) % VOCAB_SIZE
        if candidate not in top:
            top.append(candidate)
    top = top[: max(k, 1)]
    logprobs = [-(rank + (_hash(token_ids, t) % 997) / 1000) for rank, t in enumerate(top)]
    return TokenLogprobs(
        token_ids=[top[0], *top[:k]],
        logprobs=[logprobs[0], *logprobs[:k]],
        ranks=[1, *range(1, k + 1)],
    )


def reference_generate(
    prompt: list[int], params: SamplingParams, max_model_len: int, eos: int | None = EOS_TOKEN_ID
) -> list[int]:
    """What the engine must produce: the same model without any batching or paging."""
    tokens, out = list(prompt), []
    while True:
        token = next_token(tokens, params.seed)
        tokens.append(token)
        out.append(token)
        stopped = (token == eos and not params.ignore_eos) or token in params.all_stop_token_ids
        if stopped and len(out) >= params.min_tokens:
            return out
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out
        if len(tokens) >= max_model_len:
            return out


@dataclass
class _SeqState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    seed: int | None
    logprobs: int | None = None


@dataclass
class StandInWorker:
    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    states: dict[str, _SeqState] = field(default_factory=dict)
    plans: list[SchedulerOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv: list[tuple[int, int] | None] = [None] * (self.num_blocks * self.block_size)
        self.cpu_kv: list[tuple[int, int] | None] = [None] * (self.num_cpu_blocks * self.block_size)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.plans.append(plan)
        self._move_blocks(plan)
        self._apply_diffs(plan)
        request_ids, sampled, logprobs = [], [], {}
        for rid, num_tokens in plan.num_scheduled_tokens.items():
            request_ids.append(rid)
            sampled.append(self._run(rid, num_tokens))
            state = self.states[rid]
            if sampled[-1] and state.logprobs is not None:
                context = state.token_ids[:-1]
                logprobs[rid] = [top_logprobs(context, state.seed, state.logprobs)]
        return RunnerOutput(request_ids=request_ids, sampled_token_ids=sampled, logprobs=logprobs)

    def _copy(self, src, src_block: int, dst, dst_block: int) -> None:
        bs = self.block_size
        dst[dst_block * bs : (dst_block + 1) * bs] = src[src_block * bs : (src_block + 1) * bs]

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        for device_block, cpu_block in plan.blocks_to_swap_out:
            self._copy(self.kv, device_block, self.cpu_kv, cpu_block)
        for cpu_block, device_block in plan.blocks_to_swap_in:
            self._copy(self.cpu_kv, cpu_block, self.kv, device_block)
        for src, dst in plan.blocks_to_copy:
            self._copy(self.kv, src, self.kv, dst)

    def _apply_diffs(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_req_ids:
            self.states.pop(rid, None)
        for new in plan.scheduled_new_reqs:
            assert new.request_id not in self.states, f"{new.request_id} sent twice in full"
            self.states[new.request_id] = _SeqState(
                token_ids=new.prompt_token_ids + new.output_token_ids,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                seed=new.sampling_params.seed,
                logprobs=new.sampling_params.logprobs,
            )
        cached = plan.scheduled_cached_reqs
        for i, rid in enumerate(cached.request_ids):
            state = self.states[rid]  # KeyError: the plan names a request we do not hold
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                state.block_ids.extend(cached.new_block_ids[i])
            assert state.num_computed_tokens == cached.num_computed_tokens[i], rid
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _slot(self, state: _SeqState, position: int) -> int:
        block = state.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _run(self, rid: str, num_tokens: int) -> list[int]:
        state = self.states[rid]
        start = state.num_computed_tokens
        end = start + num_tokens
        assert end <= len(state.token_ids), f"{rid}: scheduled past the known tokens"
        for pos in range(start, end):
            self.kv[self._slot(state, pos)] = (state.token_ids[pos], pos)
        state.num_computed_tokens = end
        if end < len(state.token_ids):
            return []  # a middle chunk of a prefill: nothing to sample
        for pos in range(end):  # "attention": read the whole context back from the cache
            cell = self.kv[self._slot(state, pos)]
            assert cell == (state.token_ids[pos], pos), f"{rid}: KV slot {pos} holds {cell}"
        token = next_token(state.token_ids, state.seed)
        state.token_ids.append(token)
        return [token]


def run_to_completion(
    scheduler: Scheduler, worker: StandInWorker, max_steps: int = 10_000
) -> dict[str, list[int]]:
    """Drive schedule / execute / update until every request ends; outputs per request id."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not scheduler.has_pending_outputs():
            return outputs
        plan = scheduler.schedule()
        result = worker.execute(plan)
        for batch in scheduler.update_from_output(plan, result).values():
            for out in batch.outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("requests did not finish: the scheduler hangs")


def make_request(
    request_id: str,
    prompt: list[int],
    block_size: int = 16,
    **params,
) -> Request:
    params.setdefault("ignore_eos", False)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        eos_token_id=EOS_TOKEN_ID,
        block_size=block_size,
    )
