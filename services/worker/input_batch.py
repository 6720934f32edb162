"""InputBatch: the worker's persistent per-request state, updated from each SchedulerOutput.

Every request the worker holds owns a slot: a row of numpy arrays (token ids, block
table, counters, sampling columns). `update` applies a plan's diff (drop finished, add
new requests in full, apply cached deltas) and is all-or-nothing: a bad plan raises
before anything changes. `prepare` gathers the scheduled slots into the flattened
varlen batch with vectorised numpy, and `append_sampled` adds the sampled tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.worker.pooling_state import PoolingState
from services.worker.sampling_metadata import SamplingMetadata
from services.worker.sampling_ops import grammar_mask
from services.worker.sampling_table import SamplingParamsTable
from services.worker.step_inputs import (
    FlatBatch,
    PoolingInputs,
    PromptLogprobsInputs,
    StepInputs,
    flatten_batch,
    schedule_problem,
)

logger = logging.getLogger(__name__)


class InvalidPlanError(ValueError):
    """A plan the worker cannot apply (inconsistent with its state or its limits)."""


class UnknownRequestError(InvalidPlanError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"the worker holds no request with id {request_id!r}")
        self.request_id = request_id


@dataclass
class _RequestState:
    slot: int
    sampling_params: SamplingParams | None  # None: a pooling request
    pooling: PoolingState | None = None  # a pooling request's pooled state so far


class InputBatch:
    def __init__(
        self,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device | str,
        num_kv_groups: int = 1,
    ) -> None:
        """`num_kv_groups`: the KV cache groups a block table holds an entry of for each
        block position (the plan's block ids come so, position-major)."""
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("vocab_size", vocab_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_groups = num_kv_groups
        self.max_blocks_per_req = -(-max_model_len // block_size) * num_kv_groups  # entries
        self.device = torch.device(device)
        self.capacity = 0
        self._token_ids = np.zeros((0, max_model_len), np.int32)
        self._block_tables = np.zeros((0, self.max_blocks_per_req), np.int32)
        self._num_tokens = np.zeros(0, np.int64)
        self._num_prompt_tokens = np.zeros(0, np.int64)
        self._num_computed = np.zeros(0, np.int64)
        self._num_blocks = np.zeros(0, np.int64)
        self._sampling = SamplingParamsTable(0, vocab_size, eos_token_id)
        self._requests: dict[str, _RequestState] = {}
        self._prompt_logprobs_ids: set[str] = set()
        self._pooling_ids: set[str] = set()  # requests that pool instead of sampling
        # This step's speculative proposals per request (the plan's), verified in prepare.
        self._drafts: dict[str, list[int]] = {}
        self._free_slots: list[int] = []
        self._grow(max_num_seqs)

    # ---- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def token_ids(self, request_id: str) -> list[int]:
        slot = self._slot(request_id)
        return self._token_ids[slot, : self._num_tokens[slot]].tolist()

    def token_row(self, request_id: str) -> np.ndarray:
        """The request's prompt + output ids [num_tokens] (a view: do not keep it)."""
        slot = self._slot(request_id)
        return self._token_ids[slot, : self._num_tokens[slot]]

    def num_prompt_tokens(self, request_id: str) -> int:
        return int(self._num_prompt_tokens[self._slot(request_id)])

    def num_computed_tokens(self, request_id: str) -> int:
        return int(self._num_computed[self._slot(request_id)])

    def block_ids(self, request_id: str) -> list[int]:
        slot = self._slot(request_id)
        return self._block_tables[slot, : self._num_blocks[slot]].tolist()

    def sampling_params(self, request_id: str) -> SamplingParams:
        return self._state(request_id).sampling_params

    # ---- update --------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput) -> None:
        self._validate_update(plan)
        for request_id in plan.finished_req_ids:
            self._remove(request_id)
        for new in plan.scheduled_new_reqs:
            self._add(new)
        cached = plan.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed, resumed in zip(
            cached.request_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            cached.resumed_from_preemption,
            strict=True,
        ):
            slot = self._slot(request_id)
            start = 0 if resumed else int(self._num_blocks[slot])
            self._set_blocks(slot, start, new_block_ids)
            self._num_computed[slot] = num_computed
        if cached.new_token_ids:
            self._set_output_tails(cached.request_ids, cached.new_token_ids)
        self._drafts = plan.scheduled_spec_decode_tokens

    def _validate_drafts(self, plan: SchedulerOutput) -> None:
        """Proposals only for scheduled requests, in the vocabulary, and fitting in
        max_model_len after the tokens the plan leaves the request, with the target's
        token that follows them. Checked before the plan changes anything."""
        if not plan.scheduled_spec_decode_tokens:
            return
        new = {n.request_id: n for n in plan.scheduled_new_reqs}
        cached = plan.scheduled_cached_reqs
        tails = {}
        if cached.new_token_ids:
            tails = dict(
                zip(
                    cached.request_ids,
                    zip(cached.num_computed_tokens, cached.new_token_ids, strict=True),
                    strict=True,
                )
            )
        for request_id, drafts in plan.scheduled_spec_decode_tokens.items():
            if request_id not in plan.num_scheduled_tokens:
                raise InvalidPlanError(f"proposals for {request_id!r}, which is not scheduled")
            if request_id in new:
                num_tokens = len(new[request_id].prompt_token_ids)
                num_tokens += len(new[request_id].output_token_ids)
            else:
                slot = self._slot(request_id)
                num_tokens = int(self._num_tokens[slot])
                if request_id in tails:
                    num_computed, tail = tails[request_id]
                    prompt_len = int(self._num_prompt_tokens[slot])
                    num_tokens = max(num_computed, prompt_len) + len(tail)
            if num_tokens + len(drafts) + 1 > self.max_model_len:
                raise InvalidPlanError(
                    f"the proposals of {request_id!r} would exceed max_model_len "
                    f"{self.max_model_len}"
                )
            if any(not 0 <= t < self.vocab_size for t in drafts):
                raise InvalidPlanError(
                    f"the proposals of {request_id!r} hold token ids outside the vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )

    def _set_output_tails(self, request_ids: list[str], token_ids: list[list[int]]) -> None:
        """The scheduler's newest output tokens, from max(computed, prompt) on. Idempotent
        where this rank sampled them itself; how the other ranks of a group learn them."""
        slots = np.fromiter((self._slot(r) for r in request_ids), np.int64, len(request_ids))
        counts = np.fromiter((len(t) for t in token_ids), np.int64, len(token_ids))  # [S]
        starts = np.maximum(self._num_computed[slots], self._num_prompt_tokens[slots])  # [S]
        total = int(counts.sum())
        flat = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, total)  # [N]
        offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)  # [N]
        self._token_ids[np.repeat(slots, counts), np.repeat(starts, counts) + offsets] = flat
        self._num_tokens[slots] = starts + counts

    def _validate_update(self, plan: SchedulerOutput) -> None:
        cached = plan.scheduled_cached_reqs
        columns = (cached.new_block_ids, cached.num_computed_tokens, cached.resumed_from_preemption)
        if any(len(column) != len(cached.request_ids) for column in columns):
            raise InvalidPlanError("scheduled_cached_reqs columns differ in length")
        if cached.new_token_ids and len(cached.new_token_ids) != len(cached.request_ids):
            raise InvalidPlanError("scheduled_cached_reqs.new_token_ids differs in length")
        num_blocks = {}
        for new in plan.scheduled_new_reqs:
            self._validate_new(new)
            num_blocks[new.request_id] = len(new.block_ids)
        for request_id, new_block_ids, resumed in zip(
            cached.request_ids, cached.new_block_ids, cached.resumed_from_preemption, strict=True
        ):
            if request_id not in num_blocks:
                if request_id not in self._requests or request_id in plan.finished_req_ids:
                    raise UnknownRequestError(request_id)
                num_blocks[request_id] = int(self._num_blocks[self._slot(request_id)])
            num_blocks[request_id] = (0 if resumed else num_blocks[request_id]) + len(new_block_ids)
            self._check_num_blocks(request_id, num_blocks[request_id])
        self._validate_output_tails(plan)
        self._validate_drafts(plan)

    def _validate_output_tails(self, plan: SchedulerOutput) -> None:
        cached = plan.scheduled_cached_reqs
        prompt_lens = {n.request_id: len(n.prompt_token_ids) for n in plan.scheduled_new_reqs}
        for request_id, num_computed, token_ids in zip(
            cached.request_ids, cached.num_computed_tokens, cached.new_token_ids, strict=False
        ):
            prompt_len = prompt_lens.get(request_id)
            if prompt_len is None:
                prompt_len = int(self._num_prompt_tokens[self._slot(request_id)])
            if max(num_computed, prompt_len) + len(token_ids) > self.max_model_len:
                raise InvalidPlanError(
                    f"request {request_id!r} would exceed max_model_len {self.max_model_len}"
                )

    def _validate_new(self, new: NewRequestData) -> None:
        num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
        if not new.prompt_token_ids or num_tokens > self.max_model_len:
            raise InvalidPlanError(
                f"request {new.request_id!r} has {num_tokens} tokens "
                f"({len(new.prompt_token_ids)} prompt); allowed 1..{self.max_model_len}"
            )
        if not 0 <= new.num_computed_tokens <= num_tokens:
            raise InvalidPlanError(
                f"request {new.request_id!r}: num_computed_tokens {new.num_computed_tokens} "
                f"outside 0..{num_tokens}"
            )
        self._check_num_blocks(new.request_id, len(new.block_ids))

    def _check_num_blocks(self, request_id: str, num_blocks: int) -> None:
        if num_blocks > self.max_blocks_per_req:
            raise InvalidPlanError(
                f"request {request_id!r} would hold {num_blocks} blocks; "
                f"max_model_len allows {self.max_blocks_per_req}"
            )

    def _add(self, new: NewRequestData) -> None:
        if new.request_id in self._requests:
            self._remove(new.request_id)
        if not self._free_slots:
            self._grow(2 * self.capacity)
        slot = self._free_slots.pop()
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        self._token_ids[slot, : len(tokens)] = tokens
        self._num_tokens[slot] = len(tokens)
        self._num_prompt_tokens[slot] = len(new.prompt_token_ids)
        self._num_computed[slot] = new.num_computed_tokens
        self._set_blocks(slot, 0, new.block_ids)
        state = _RequestState(slot, new.sampling_params)
        if new.pooling_params is not None:  # a fresh pooled state, from position 0
            state.pooling = PoolingState(new.pooling_params)
            self._pooling_ids.add(new.request_id)
        else:
            self._sampling.set_row(slot, new.sampling_params)
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs_ids.add(new.request_id)
        self._requests[new.request_id] = state

    def _remove(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return  # finished before the worker ever saw it (aborted while waiting)
        self._prompt_logprobs_ids.discard(request_id)
        self._pooling_ids.discard(request_id)
        self._sampling.clear_row(state.slot)
        self._free_slots.append(state.slot)

    def _set_blocks(self, slot: int, start: int, block_ids: Sequence[int]) -> None:
        end = start + len(block_ids)
        self._block_tables[slot, start:end] = block_ids
        if start == 0:
            self._block_tables[slot, end:] = 0
        self._num_blocks[slot] = end

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        if self.capacity:
            logger.info("InputBatch grows from %d to %d slots", self.capacity, capacity)

        def pad(array: np.ndarray) -> np.ndarray:
            return np.concatenate([array, np.zeros((extra, *array.shape[1:]), array.dtype)])

        self._token_ids = pad(self._token_ids)
        self._block_tables = pad(self._block_tables)
        self._num_tokens = pad(self._num_tokens)
        self._num_prompt_tokens = pad(self._num_prompt_tokens)
        self._num_computed = pad(self._num_computed)
        self._num_blocks = pad(self._num_blocks)
        self._sampling.grow(capacity)
        self._free_slots.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(request_id)
        return state

    def _slot(self, request_id: str) -> int:
        return self._state(request_id).slot

    # ---- prepare -------------------------------------------------------------------------

    def prepare(self, plan: SchedulerOutput, with_sampling: bool = True) -> StepInputs:
        """The flattened batch; `with_sampling` False leaves out the sampling metadata
        (ranks of a worker group that do not sample)."""
        request_ids = list(plan.num_scheduled_tokens)
        slots = np.fromiter((self._slot(r) for r in request_ids), np.int64, len(request_ids))
        num_scheduled = np.fromiter(plan.num_scheduled_tokens.values(), np.int64, len(slots))
        num_computed = self._num_computed[slots]
        num_drafts = self._write_drafts(request_ids, slots)  # [S]
        num_known = self._num_tokens[slots] + num_drafts  # [S]
        self._check_schedule(plan, request_ids, num_known, slots, num_computed, num_scheduled)
        flat = flatten_batch(
            self._token_ids,
            *self._grouped_tables(),
            slots,
            num_known,
            num_computed,
            num_scheduled,
            self.block_size,
        )
        pool_rows = self._pooling_rows(request_ids)
        samples = flat.samples
        pooling = None
        if pool_rows:  # pooling requests sample nothing
            samples = samples.copy()
            samples[pool_rows] = False
            pooling = self._pooling_inputs(request_ids, pool_rows, slots, num_computed, flat)
        sample_rows = np.nonzero(samples)[0]  # [R]
        sampling_ids = [request_ids[row] for row in sample_rows.tolist()]
        # one logits row per verified position: the last num_drafts + 1 tokens  [L]
        per_row = num_drafts[sample_rows] + 1  # [R]
        back = np.arange(int(per_row.sum())) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        last = np.repeat(flat.logits_indices[sample_rows], per_row)  # [L]
        logits_indices = last - np.repeat(per_row - 1, per_row) + back  # [L]
        metadata = None
        if len(sample_rows) and with_sampling:
            row_slots = np.repeat(slots[sample_rows], per_row)  # [L]
            metadata = self._sampling.make_metadata(
                row_slots,
                self._token_ids,
                self._num_prompt_tokens[row_slots],
                np.repeat(self._num_tokens[slots[sample_rows]], per_row) + back,
                self.device,
            )
            first_rows = np.cumsum(per_row) - per_row
            first_row = dict(zip(sampling_ids, first_rows.tolist(), strict=True))
            mask = grammar_mask(plan, first_row, self.vocab_size, self.device)
            if mask is not None:
                metadata = dataclasses.replace(metadata, grammar=mask)
        inputs = self._step_inputs(
            request_ids,
            flat,
            num_scheduled,
            logits_indices,
            sampling_ids,
            metadata,
            self._drafts,
            self._prompt_logprobs_inputs(
                request_ids, slots, num_computed, num_scheduled, flat.query_start_loc
            ),
        )
        return inputs if pooling is None else dataclasses.replace(inputs, pooling=pooling)

    def _step_inputs(
        self,
        request_ids: list[str],
        flat: FlatBatch,
        num_scheduled: np.ndarray,
        logits_indices: np.ndarray,
        sampling_ids: list[str],
        metadata: SamplingMetadata | None,
        draft_token_ids: dict[str, list[int]],
        prompt_logprobs: PromptLogprobsInputs | None,
    ) -> StepInputs:
        """The flattened batch on the device, with what samples from it."""
        return StepInputs(
            request_ids=request_ids,
            input_ids=self._to_device(flat.input_ids),
            positions=self._to_device(flat.positions),
            slot_mapping=self._to_device(flat.slot_mapping),
            query_start_loc=self._to_device(flat.query_start_loc),
            seq_lens=self._to_device(flat.seq_lens),
            block_table=self._to_device(flat.block_table),
            max_query_len=int(num_scheduled.max(initial=0)),
            max_seq_len=int(flat.seq_lens.max(initial=0)),
            query_start_loc_host=flat.query_start_loc.tolist(),
            seq_lens_host=flat.seq_lens.tolist(),
            logits_indices=self._to_device(logits_indices),
            sampling_request_ids=sampling_ids,
            sampling_metadata=metadata,
            draft_token_ids=draft_token_ids,
            prompt_logprobs=prompt_logprobs,
        )

    def _write_drafts(self, request_ids: list[str], slots: np.ndarray) -> np.ndarray:
        """Each request's proposals written after its known tokens (where its next tokens
        go, so the accepted ones are in place already); how many each has  [S]."""
        num_drafts = np.zeros(len(request_ids), np.int64)
        if not self._drafts:
            return num_drafts
        for row, request_id in enumerate(request_ids):
            drafts = self._drafts.get(request_id)
            if drafts:
                slot, start = int(slots[row]), int(self._num_tokens[slots[row]])
                self._token_ids[slot, start : start + len(drafts)] = drafts
                num_drafts[row] = len(drafts)
        return num_drafts

    def _check_schedule(
        self,
        plan: SchedulerOutput,
        request_ids: list[str],
        num_known: np.ndarray,
        slots: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> None:
        problem = schedule_problem(
            num_computed,
            num_scheduled,
            num_known,
            self._num_slots(slots),
            plan.total_num_scheduled_tokens,
        )
        if problem is None and self._drafts:
            seq_lens = num_computed + num_scheduled
            for row, request_id in enumerate(request_ids):
                if request_id in self._drafts and seq_lens[row] != num_known[row]:
                    problem = row, "verifies proposals but does not schedule all of them"
                    break
        if problem is not None:
            row, message = problem
            name = "plan" if row is None else f"plan for request {request_ids[row]!r}"
            raise InvalidPlanError(f"{name} {message}")

    def _pooling_rows(self, request_ids: list[str]) -> list[int]:
        """The rows of the step's pooling requests (none without any held)."""
        if not self._pooling_ids:
            return []
        return [row for row, rid in enumerate(request_ids) if rid in self._pooling_ids]

    def _pooling_inputs(
        self,
        request_ids: list[str],
        rows: list[int],
        slots: np.ndarray,
        num_computed: np.ndarray,
        flat: FlatBatch,
    ) -> PoolingInputs:
        starts = flat.query_start_loc
        return PoolingInputs(
            request_ids=[request_ids[row] for row in rows],
            row_starts=[int(starts[row]) for row in rows],
            row_ends=[int(starts[row + 1]) for row in rows],
            first_positions=[int(num_computed[row]) for row in rows],
            num_prompt_tokens=[int(self._num_prompt_tokens[slots[row]]) for row in rows],
            states=[self._requests[request_ids[row]].pooling for row in rows],
        )

    def _prompt_logprobs_inputs(
        self,
        request_ids: list[str],
        slots: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> PromptLogprobsInputs | None:
        if not self._prompt_logprobs_ids:
            return None
        names, num_rows, firsts, ks, indices, targets = [], [], [], [], [], []
        for row, request_id in enumerate(request_ids):
            if request_id not in self._prompt_logprobs_ids:
                continue
            slot, start = int(slots[row]), int(num_computed[row])
            stop = min(start + int(num_scheduled[row]), int(self._num_prompt_tokens[slot]) - 1)
            if stop <= start:
                continue
            names.append(request_id)
            num_rows.append(stop - start)
            firsts.append(start + 1)
            ks.append(self._requests[request_id].sampling_params.prompt_logprobs)
            indices.append(query_start_loc[row] + np.arange(stop - start, dtype=np.int64))
            targets.append(self._token_ids[slot, start + 1 : stop + 1].astype(np.int64))
        if not names:
            return None
        return PromptLogprobsInputs(
            request_ids=names,
            num_rows=num_rows,
            first_positions=firsts,
            num_logprobs=ks,
            token_indices=self._to_device(np.concatenate(indices).astype(np.int64)),
            target_ids=self._to_device(np.concatenate(targets)),
        )

    def positions(self, request_ids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(num_computed_tokens as the last plan set them, known tokens, KV slots in the
        block table) per request  [S] each."""
        slots = np.fromiter((self._slot(r) for r in request_ids), np.int64, len(request_ids))
        return self._num_computed[slots], self._num_tokens[slots], self._num_slots(slots)

    def _grouped_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The tables as [capacity, max_positions, G] (a view) and their positions."""
        groups = self.num_kv_groups
        tables = self._block_tables.reshape(self.capacity, -1, groups)
        return tables, self._num_blocks // groups

    def _num_slots(self, slots: np.ndarray) -> np.ndarray:
        """KV slots in each slot's block table [S]."""
        return self._num_blocks[slots] // self.num_kv_groups * self.block_size

    def write_tokens(self, request_ids: list[str], positions: np.ndarray, token_ids) -> None:
        """Token ids past the requests' known tokens (proposals being made), so a forward
        pass over those positions reads them; they count once appended or scheduled."""
        slots = np.fromiter((self._slot(r) for r in request_ids), np.int64, len(request_ids))
        self._token_ids[slots, positions] = token_ids

    def forward_inputs(
        self, request_ids: list[str], num_computed: np.ndarray, num_scheduled: np.ndarray
    ) -> StepInputs:
        """A forward pass over positions num_computed .. + num_scheduled of each request
        (a draft model's steps), its logits rows the last of each; nothing is sampled."""
        slots = np.fromiter((self._slot(r) for r in request_ids), np.int64, len(request_ids))
        seq_lens = num_computed + num_scheduled
        flat = flatten_batch(
            self._token_ids,
            *self._grouped_tables(),
            slots,
            seq_lens,
            num_computed,
            num_scheduled,
            self.block_size,
        )
        return self._step_inputs(
            request_ids, flat, num_scheduled, flat.logits_indices, request_ids, None, {}, None
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    # ---- after sampling ------------------------------------------------------------------

    def append_sampled(self, request_ids: list[str], token_ids: list[list[int]]) -> None:
        if len(request_ids) != len(token_ids) or len(set(request_ids)) != len(request_ids):
            raise ValueError("append_sampled needs unique request ids, one token list each")
        slots = np.fromiter((self._slot(r) for r in request_ids), np.int64, len(request_ids))
        counts = np.fromiter((len(t) for t in token_ids), np.int64, len(token_ids))  # [S]
        new_num_tokens = self._num_tokens[slots] + counts
        if (new_num_tokens > self.max_model_len).any():
            row = int(np.argmax(new_num_tokens > self.max_model_len))
            raise InvalidPlanError(
                f"request {request_ids[row]!r} would exceed max_model_len {self.max_model_len}"
            )
        total = int(counts.sum())
        flat_tokens = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, total)
        starts = np.cumsum(counts) - counts  # [S]
        cols = np.repeat(self._num_tokens[slots] - starts, counts) + np.arange(total)  # [N]
        self._token_ids[np.repeat(slots, counts), cols] = flat_tokens
        self._num_tokens[slots] = new_num_tokens
