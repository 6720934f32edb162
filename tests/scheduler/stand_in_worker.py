"""A deterministic, torch-free stand-in for the worker: one class for every scheduler test.

It follows the plan's diff protocol exactly as the real worker must (new requests in
full, deltas for the rest, finished ids dropped) and keeps a fake paged KV cache in
which every slot records the (token, position, adapter) written there. Before it
"samples", it reads the whole context back through the block table and checks every
slot, so a wrong block table, a missed copy-on-write, a lost swap or a prefix-cache block
shared across LoRA adapters fails loudly. The next token is a pure function of the
sequence so far, the seed and the row's adapter, so outputs can be compared with a plain
reference loop (`reference_generate`). When a request asks for logprobs (beam search
does), it also returns a deterministic top-k list led by that token.

What the real worker does beside generation, it plays the same way:
- LoRA (`max_loras` slots): it fills slots only as plans say (`lora_adapters`) and runs
  each row with the adapter in the slot the plan gives it (`lora_slots`): the model under
  a seed that holds the adapter's identity, so a row run with another adapter than its
  request's gives another output than the reference.
- Speculative decoding (`proposer`): it verifies the plan's proposals (the target's token
  at every verified position, the accepted prefix plus one) and proposes after every
  step. With `lookahead` > 0 it also plays the draft model: a second fake cache in the
  same block tables, caught up over the positions the target computed this step (+1) and
  written at the proposals' positions, which must lie inside the table (the scheduler's
  lookahead slots); the draft reads its own context back before it proposes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.lora_request import LoRARequest
from services.common.runner_output import RunnerOutput, TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

VOCAB_SIZE = 1000
EOS_TOKEN_ID = 0

# (request_id, token_ids, seed, room) -> proposals (at most room of them)
Proposer = Callable[[str, list[int], object, int], list[int]]
Cell = tuple[int, int, str | None]  # (token, position, the adapter that wrote it)


def _hash(*key) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def model_seed(seed: int | None, adapter: str | None) -> object:
    """The stand-in model with an adapter is the base one under another seed."""
    return seed if adapter is None else (seed, adapter)


def next_token(token_ids: list[int], seed: object) -> int:
    """The stand-in model: a hash of the sequence so far (never EOS unless by chance)."""
    return _hash(seed, token_ids) % VOCAB_SIZE


def top_logprobs(token_ids: list[int], seed: object, k: int) -> TokenLogprobs:
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
    prompt: list[int],
    params: SamplingParams,
    max_model_len: int,
    eos: int | None = EOS_TOKEN_ID,
    lora: LoRARequest | None = None,
) -> list[int]:
    """What the engine must produce: the same model (with `lora`) unbatched and unpaged."""
    seed = model_seed(params.seed, lora.identity if lora is not None else None)
    tokens, out = list(prompt), []
    while True:
        token = next_token(tokens, seed)
        tokens.append(token)
        out.append(token)
        stopped = (token == eos and not params.ignore_eos) or token in params.all_stop_token_ids
        if stopped and len(out) >= params.min_tokens:
            return out
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out
        if len(tokens) >= max_model_len:
            return out


# ---- proposers -------------------------------------------------------------------------
def true_continuation(token_ids: list[int], seed: object, count: int) -> list[int]:
    """The next `count` tokens the stand-in model will produce (proposals all accepted)."""
    tokens = list(token_ids)
    for _ in range(count):
        tokens.append(next_token(tokens, seed))
    return tokens[len(token_ids) :]


def wrong_token(token_ids: list[int], seed: object) -> int:
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


# ---- the worker ------------------------------------------------------------------------
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
    max_loras: int = 0  # LoRA slots (0: LoRA off)
    proposer: Proposer | None = None  # speculative decoding (None: off)
    max_model_len: int = 2048  # proposals never run past it
    lookahead: int = 0  # > 0: play the draft model and its cache
    states: dict[str, _SeqState] = field(default_factory=dict)
    plans: list[SchedulerOutput] = field(default_factory=list)
    slots: list[str | None] = field(default_factory=list)  # each LoRA slot's adapter identity
    loads: int = 0  # adapters written into a slot
    beams: set[str] = field(default_factory=set)  # beam search sequences: no proposals

    def __post_init__(self) -> None:
        slots, cpu_slots = self.num_blocks * self.block_size, self.num_cpu_blocks * self.block_size
        self.kv: list[Cell | None] = [None] * slots
        self.cpu_kv: list[Cell | None] = [None] * cpu_slots
        self.draft_kv: list[Cell | None] = [None] * slots
        self.draft_cpu_kv: list[Cell | None] = [None] * cpu_slots
        self.slots = [None] * self.max_loras

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.plans.append(plan)
        self._load_adapters(plan)
        self._move_blocks(plan)
        self._apply_diffs(plan)
        request_ids, sampled, logprobs, proposals = [], [], {}, {}
        for rid, num_tokens in plan.num_scheduled_tokens.items():
            state = self.states[rid]
            adapter = self.row_adapter(plan, rid)
            seed = model_seed(state.seed, adapter)
            start, known = state.num_computed_tokens, len(state.token_ids)
            drafts = plan.scheduled_spec_decode_tokens.get(rid, [])
            tokens = self._verify(rid, num_tokens, drafts, adapter)
            request_ids.append(rid)
            sampled.append(tokens)
            if tokens and state.logprobs is not None:
                logprobs[rid] = [
                    top_logprobs(state.token_ids[: known + i], seed, state.logprobs)
                    for i in range(len(tokens))
                ]
            if self.lookahead:
                self._draft_catch_up(rid, start, num_tokens)
            proposing = tokens and self.proposer is not None and rid not in self.beams
            if proposing and (props := self._propose(rid, seed)):
                proposals[rid] = props
        return RunnerOutput(
            request_ids=request_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            spec_token_ids=proposals,
        )

    def row_adapter(self, plan: SchedulerOutput, rid: str) -> str | None:
        slot = plan.lora_slots.get(rid)
        return None if slot is None else self.slots[slot]

    def _load_adapters(self, plan: SchedulerOutput) -> None:
        for slot, lora in plan.lora_adapters.items():
            assert 0 <= slot < self.max_loras, f"slot {slot} of {self.max_loras}"
            if self.slots[slot] != lora.identity:
                self.slots[slot] = lora.identity
                self.loads += 1
        for rid, slot in plan.lora_slots.items():
            assert rid in plan.num_scheduled_tokens, f"{rid} has a slot but no row"
            assert slot in plan.lora_adapters, f"{rid}'s slot {slot} is not in the plan"

    def _copy(self, src, src_block: int, dst, dst_block: int) -> None:
        bs = self.block_size
        dst[dst_block * bs : (dst_block + 1) * bs] = src[src_block * bs : (src_block + 1) * bs]

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        """Swaps and copy-on-write copies, in the target's cache and the draft's alike."""
        for kv, cpu_kv in ((self.kv, self.cpu_kv), (self.draft_kv, self.draft_cpu_kv)):
            for device_block, cpu_block in plan.blocks_to_swap_out:
                self._copy(kv, device_block, cpu_kv, cpu_block)
            for cpu_block, device_block in plan.blocks_to_swap_in:
                self._copy(cpu_kv, cpu_block, kv, device_block)
            for src, dst in plan.blocks_to_copy:
                self._copy(kv, src, kv, dst)

    def _apply_diffs(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_req_ids:
            self.states.pop(rid, None)
        for new in plan.scheduled_new_reqs:
            assert new.request_id not in self.states, f"{new.request_id} sent twice in full"
            self.states[new.request_id] = _SeqState(
                token_ids=new.prompt_token_ids + new.output_token_ids,
                block_ids=list(new.block_table[0]),  # one KV cache group
                num_computed_tokens=new.num_computed_tokens,
                seed=new.kind.seed,
                logprobs=new.kind.logprobs,
            )
            if new.kind.use_beam_search:
                self.beams.add(new.request_id)
        cached = plan.scheduled_cached_reqs
        for i, rid in enumerate(cached.request_ids):
            state = self.states[rid]  # KeyError: the plan names a request we do not hold
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i][0])
            else:
                state.block_ids.extend(cached.new_block_ids[i][0])
            assert state.num_computed_tokens == cached.num_computed_tokens[i], rid
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _slot(self, state: _SeqState, position: int) -> int:
        block = state.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _verify(self, rid: str, num_tokens: int, drafts: list[int], adapter: str | None):
        """The row's forward: its scheduled positions written, then (at the end of the
        known tokens and proposals) the whole context read back and the target's token
        at every verified position; [] for a middle chunk of a prefill."""
        state = self.states[rid]
        known = len(state.token_ids)
        context = state.token_ids + list(drafts)
        start = state.num_computed_tokens
        end = start + num_tokens
        assert end <= len(context), f"{rid}: scheduled past the known tokens and proposals"
        assert not drafts or end == len(context), f"{rid}: proposals not all scheduled"
        for pos in range(start, end):
            self.kv[self._slot(state, pos)] = (context[pos], pos, adapter)
        if end < len(context):
            state.num_computed_tokens = end
            return []
        for pos in range(end):  # "attention" over the context, proposals included
            cell = self.kv[self._slot(state, pos)]
            assert cell is not None and cell[:2] == (context[pos], pos), (
                f"{rid}: KV slot {pos} holds {cell}"
            )
            assert cell[2] == adapter, f"{rid} ({adapter}) reads KV of {cell[2]} at {pos}"
        seed = model_seed(state.seed, adapter)
        out = []
        for i in range(len(drafts) + 1):
            token = next_token(context[: known + i], seed)
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                break
        state.token_ids += out
        state.num_computed_tokens = len(state.token_ids) - 1  # rejected positions roll back
        return out

    def _propose(self, rid: str, seed: object) -> list[int]:
        state = self.states[rid]
        room = max(self.max_model_len - len(state.token_ids) - 1, 0)
        props = self.proposer(rid, list(state.token_ids), seed, room)
        assert len(props) <= room, (rid, props, room)
        return self._draft_write(rid, props) if self.lookahead else props

    def _draft_catch_up(self, rid: str, start: int, count: int) -> None:
        """The draft's forward over what the target computed this step, +1 (as
        DraftModelProposer: up to the last known token, within the table)."""
        state = self.states[rid]
        num_slots = len(state.block_ids) * self.block_size
        end = min(len(state.token_ids), start + count + 1, num_slots)
        for pos in range(start, end):
            self.draft_kv[self._slot(state, pos)] = (state.token_ids[pos], pos, None)

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
            expected = (state.token_ids[pos], pos, None)
            assert cell == expected, f"{rid}: draft KV slot {pos} holds {cell}"
        kept = props[: max(num_slots - num_tokens + 1, 0)]
        for i, token in enumerate(kept[:-1]):
            self.draft_kv[self._slot(state, num_tokens + i)] = (token, num_tokens + i, None)
        return kept


# ---- driving it ------------------------------------------------------------------------
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


def adapter(name: str, int_id: int | None = None, digest: str = "d0") -> LoRARequest:
    """A checked adapter (the frontend stamps the digest; here it is made up)."""
    return LoRARequest(name, int_id or sum(map(ord, name)), f"/adapters/{name}", digest=digest)


def make_request(
    request_id: str,
    prompt: list[int],
    block_size: int = 16,
    lora: LoRARequest | None = None,
    cache_salt: str | None = None,
    **params,
) -> Request:
    """A scheduler request for `prompt` (run with `lora`; None: the base model)."""
    params.setdefault("ignore_eos", False)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        eos_token_id=EOS_TOKEN_ID,
        block_size=block_size,
        cache_salt=cache_salt,
        lora_request=lora,
    )
