"""A stand-in worker with LoRA slots, played as the real worker plays them.

It holds `max_loras` slots and fills them only as plans say (`lora_adapters`: every slot a
step uses, with its adapter); each row computes with the adapter in the slot the plan
gives it (`lora_slots`), or the base model. With an adapter the stand-in model is the base
one under a seed that holds the adapter's identity (its tokens and logprobs both), so a
row run with another adapter than its request's gives another output than
`reference_generate`. Every KV slot records
the adapter that wrote it besides (token, position), and a row reading a slot another
adapter wrote (a prefix-cache block shared across adapters) fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.lora_request import LoRARequest
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.request import Request
from tests.scheduler.stand_in_worker import EOS_TOKEN_ID, StandInWorker, top_logprobs
from tests.scheduler.stand_in_worker import next_token as base_next_token


def _seed(seed: int | None, adapter: str | None):
    """The stand-in model with an adapter is the base one under another seed."""
    return seed if adapter is None else (seed, adapter)


def next_token(token_ids: list[int], seed: int | None, adapter: str | None) -> int:
    return base_next_token(token_ids, _seed(seed, adapter))


def reference_generate(
    prompt: list[int], params: SamplingParams, adapter: LoRARequest | None, max_model_len: int
) -> list[int]:
    """What the engine must produce: the model with `adapter`, unbatched and unpaged."""
    identity = adapter.identity if adapter is not None else None
    tokens, out = list(prompt), []
    while True:
        token = next_token(tokens, params.seed, identity)
        tokens.append(token)
        out.append(token)
        stopped = (token == EOS_TOKEN_ID and not params.ignore_eos) or (
            token in params.all_stop_token_ids
        )
        if stopped and len(out) >= params.min_tokens:
            return out
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out
        if len(tokens) >= max_model_len:
            return out


def adapter(name: str, int_id: int | None = None, digest: str = "d0") -> LoRARequest:
    """A checked adapter (the frontend stamps the digest; here it is made up)."""
    return LoRARequest(name, int_id or sum(map(ord, name)), f"/adapters/{name}", digest=digest)


def make_lora_request(
    request_id: str,
    prompt: list[int],
    lora: LoRARequest | None,
    block_size: int = 16,
    cache_salt: str | None = None,
    **params,
) -> Request:
    """make_request's request, run with `lora` (None: the base model)."""
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


@dataclass
class LoRAStandInWorker(StandInWorker):
    max_loras: int = 1
    slots: list[str | None] = field(default_factory=list)  # each slot's adapter identity
    loads: int = 0  # adapters written into a slot
    _plan: SchedulerOutput | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.slots = [None] * self.max_loras
        self.kv_adapter: list[str | None] = [None] * (self.num_blocks * self.block_size)
        self.cpu_kv_adapter: list[str | None] = [None] * (self.num_cpu_blocks * self.block_size)

    def execute(self, plan: SchedulerOutput):
        for slot, lora in plan.lora_adapters.items():
            assert 0 <= slot < self.max_loras, f"slot {slot} of {self.max_loras}"
            if self.slots[slot] != lora.identity:
                self.slots[slot] = lora.identity
                self.loads += 1
        for rid, slot in plan.lora_slots.items():
            assert rid in plan.num_scheduled_tokens, f"{rid} has a slot but no row"
            assert slot in plan.lora_adapters, f"{rid}'s slot {slot} is not in the plan"
        self._plan = plan
        output = super().execute(plan)
        for rid in output.logprobs:  # led by the token the row's adapter sampled
            state = self.states[rid]
            seed = _seed(state.seed, self.row_adapter(rid))
            output.logprobs[rid] = [top_logprobs(state.token_ids[:-1], seed, state.logprobs)]
        return output

    def _copy(self, src, src_block: int, dst, dst_block: int) -> None:
        super()._copy(src, src_block, dst, dst_block)
        tags = {id(self.kv): self.kv_adapter, id(self.cpu_kv): self.cpu_kv_adapter}
        super()._copy(tags[id(src)], src_block, tags[id(dst)], dst_block)

    def row_adapter(self, rid: str) -> str | None:
        slot = self._plan.lora_slots.get(rid)
        return None if slot is None else self.slots[slot]

    def _run(self, rid: str, num_tokens: int) -> list[int]:
        state = self.states[rid]
        identity = self.row_adapter(rid)
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
        assert end <= len(state.token_ids), f"{rid}: scheduled past the known tokens"
        for pos in range(start, end):
            slot = self._slot(state, pos)
            self.kv[slot] = (state.token_ids[pos], pos)
            self.kv_adapter[slot] = identity
        state.num_computed_tokens = end
        if end < len(state.token_ids):
            return []
        for pos in range(end):
            slot = self._slot(state, pos)
            assert self.kv[slot] == (state.token_ids[pos], pos), f"{rid}: KV slot {pos}"
            writer = self.kv_adapter[slot]
            assert writer == identity, f"{rid} ({identity}) reads KV of {writer} at {pos}"
        token = next_token(state.token_ids, state.seed, identity)
        state.token_ids.append(token)
        return [token]
