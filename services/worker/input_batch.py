"""InputBatch: the worker's persistent per-request state, updated from each SchedulerOutput.

Every request the worker holds owns a slot: a row of numpy arrays (token ids, a block
table per KV cache group, counters, sampling columns). A plan is trusted as built (one
from the wire was checked where it was decoded); what only this state tells (an id it does
not hold, a row without room) raises InvalidPlanError before `update` changes anything.
`prepare` gathers the scheduled slots into the flattened batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.common.convert.plan_limits import PlanLimits
from services.common.image_input import ImageInput
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import (
    BlockTable,
    NewRequestData,
    RequestKind,
    SchedulerOutput,
)
from services.worker.multimodal.image_key_limits import image_key_limits
from services.worker.multimodal.image_slice import ImageSlice, image_slices
from services.worker.multimodal.mrope_positions import prompt_mrope_positions, rope_positions
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
    kind: RequestKind
    pooling: PoolingState | None = None  # a pooling request's pooled state so far
    images: tuple[ImageInput, ...] = ()
    # M-RoPE: the prompt's positions [3, P] and the delta past it (on first need)
    rope: tuple[np.ndarray, int] | None = None


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
        image_token_id: int | None = None,
    ) -> None:
        """`num_kv_groups`: the KV cache groups a plan's block tables hold (BlockTable);
        `image_token_id`: a vision-language model's (None: the model takes no images)."""
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
        self.max_model_len = max_model_len  # a row's room for tokens
        self.num_kv_groups = num_kv_groups
        self.image_token_id = image_token_id
        # the model's image tokens attend to their whole image (Gemma 3's; the worker sets
        # it): the steps through images carry each row's key limit
        self.bidirectional_images = False
        # an M-RoPE model's spatial merge size (the worker sets it): the steps' positions
        # are [3, T] (temporal, row, column), multimodal/mrope_positions.py
        self.mrope_merge_size: int | None = None
        self.max_positions = -(-max_model_len // block_size)  # a row's room for blocks
        self.device = torch.device(device)
        self.capacity = 0
        self._token_ids = np.zeros((0, max_model_len), np.int32)
        # [G, capacity, max_positions]: group g's table of each slot
        self._block_tables = np.zeros((num_kv_groups, 0, self.max_positions), np.int32)
        self._num_tokens = np.zeros(0, np.int64)
        self._num_prompt_tokens = np.zeros(0, np.int64)
        self._num_computed = np.zeros(0, np.int64)
        self._num_positions = np.zeros(0, np.int64)  # block positions in each slot's tables
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

    def block_table(self, request_id: str) -> BlockTable:
        slot = self._slot(request_id)
        return tuple(self._block_tables[:, slot, : self._num_positions[slot]].tolist())

    def sampling_params(self, request_id: str) -> SamplingParams:
        """A generating request's params (a pooling request has none)."""
        kind = self._state(request_id).kind
        assert isinstance(kind, SamplingParams), f"{request_id!r} is a pooling request"
        return kind

    @property
    def limits(self) -> PlanLimits:
        return PlanLimits(self.max_model_len, self.block_size, self.vocab_size, self.num_kv_groups)

    # ---- update --------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput) -> None:
        self._check_against_state(plan)
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
            start = 0 if resumed else int(self._num_positions[slot])
            self._set_blocks(slot, start, new_block_ids)
            self._num_computed[slot] = num_computed
        if cached.new_token_ids:
            self._set_output_tails(cached.request_ids, cached.new_token_ids)
        self._drafts = plan.scheduled_spec_decode_tokens

    def _check_drafts(self, plan: SchedulerOutput) -> None:
        """The proposals fit the request's row after the tokens the plan leaves it, with
        the target's token that follows them."""
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
            if request_id in new:
                continue  # a new request's length is the plan's own (PlanLimits.check)
            slot = self._slot(request_id)
            num_tokens = int(self._num_tokens[slot])
            if request_id in tails:
                num_computed, tail = tails[request_id]
                num_tokens = max(num_computed, int(self._num_prompt_tokens[slot])) + len(tail)
            if num_tokens + len(drafts) + 1 > self.max_model_len:
                raise InvalidPlanError(
                    f"the proposals of {request_id!r} would exceed max_model_len "
                    f"{self.max_model_len}"
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

    def _check_against_state(self, plan: SchedulerOutput) -> None:
        """What only this worker's state tells: every delta names a request it holds (and
        the plan does not drop), and every row keeps room for its blocks and tokens."""
        cached = plan.scheduled_cached_reqs
        num_positions = {new.request_id: len(new.block_table[0]) for new in plan.scheduled_new_reqs}
        for request_id, new_block_ids, resumed in zip(
            cached.request_ids, cached.new_block_ids, cached.resumed_from_preemption, strict=True
        ):
            if request_id not in num_positions:
                if request_id not in self._requests or request_id in plan.finished_req_ids:
                    raise UnknownRequestError(request_id)
                num_positions[request_id] = int(self._num_positions[self._slot(request_id)])
            held = 0 if resumed else num_positions[request_id]
            num_positions[request_id] = held + len(new_block_ids[0])
            if num_positions[request_id] > self.max_positions:
                raise InvalidPlanError(
                    f"request {request_id!r} would hold {num_positions[request_id]} blocks "
                    f"per KV cache group; max_model_len allows {self.max_positions}"
                )
        self._check_output_tails(plan)
        self._check_drafts(plan)
        for new in plan.scheduled_new_reqs:
            if new.images and self.image_token_id is None:
                raise InvalidPlanError(
                    f"request {new.request_id!r} has images: this model takes none"
                )

    def _check_output_tails(self, plan: SchedulerOutput) -> None:
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
        self._set_blocks(slot, 0, new.block_table)
        state = _RequestState(slot, new.kind, images=new.images)
        match new.kind:
            case PoolingParams() as params:  # a fresh pooled state, from position 0
                state.pooling = PoolingState(params)
                self._pooling_ids.add(new.request_id)
            case SamplingParams() as params:
                self._sampling.set_row(slot, params)
                if params.prompt_logprobs is not None:
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

    def _set_blocks(self, slot: int, start: int, table: BlockTable) -> None:
        """Write every group's ids from block position `start` on."""
        end = start + len(table[0])
        self._block_tables[:, slot, start:end] = table
        if start == 0:
            self._block_tables[:, slot, end:] = 0
        self._num_positions[slot] = end

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        if self.capacity:
            logger.info("InputBatch grows from %d to %d slots", self.capacity, capacity)

        def pad(array: np.ndarray, axis: int = 0) -> np.ndarray:
            shape = list(array.shape)
            shape[axis] = extra
            return np.concatenate([array, np.zeros(shape, array.dtype)], axis=axis)

        self._token_ids = pad(self._token_ids)
        self._block_tables = pad(self._block_tables, axis=1)
        self._num_tokens = pad(self._num_tokens)
        self._num_prompt_tokens = pad(self._num_prompt_tokens)
        self._num_computed = pad(self._num_computed)
        self._num_positions = pad(self._num_positions)
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
        self._check_schedule(request_ids, num_known, slots, num_computed, num_scheduled)
        flat = flatten_batch(
            self._token_ids,
            self._block_tables,
            self._num_positions,
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
        if self.mrope_merge_size is not None:
            positions = self._mrope_positions(request_ids, slots, flat)
            inputs = dataclasses.replace(inputs, positions=positions)
        images = self._image_slices(request_ids, slots, num_computed, num_scheduled, flat)
        key_limits = None
        if images and self.bidirectional_images:
            key_limits = self._key_limits(request_ids, slots, num_scheduled, flat, images)
        return dataclasses.replace(inputs, pooling=pooling, images=images, key_limits=key_limits)

    def _key_limits(
        self,
        request_ids: list[str],
        slots: np.ndarray,
        num_scheduled: np.ndarray,
        flat: FlatBatch,
        images: list[ImageSlice],
    ) -> torch.Tensor:
        """[T] int32 each row's key limit (image_key_limits.py) on the device."""
        rows = {r: self._token_ids[slot] for r, slot in zip(request_ids, slots, strict=True)}
        chunk_ends = np.repeat(flat.seq_lens.astype(np.int64), num_scheduled)  # [T]
        limits = image_key_limits(flat.positions, chunk_ends, images, rows, self.image_token_id)
        return self._to_device(limits)

    def _mrope_positions(
        self, request_ids: list[str], slots: np.ndarray, flat: FlatBatch
    ) -> torch.Tensor:
        """[3, T] the step's M-RoPE positions on the device: a request with images takes
        its prompt's table (computed on first need) and index + delta past the prompt,
        any other all three equal to the KV index."""
        positions = np.broadcast_to(flat.positions, (3, len(flat.positions))).copy()
        starts = flat.query_start_loc
        for row, request_id in enumerate(request_ids):
            state = self._requests[request_id]
            if not state.images:
                continue
            if state.rope is None:
                prompt_len = int(self._num_prompt_tokens[slots[row]])
                try:
                    state.rope = prompt_mrope_positions(
                        state.images, prompt_len, self.mrope_merge_size
                    )
                except ValueError as exc:
                    raise InvalidPlanError(str(exc)) from None
            rows = slice(int(starts[row]), int(starts[row + 1]))
            positions[:, rows] = rope_positions(flat.positions[rows], *state.rope)
        return self._to_device(positions)

    def _image_slices(
        self,
        request_ids: list[str],
        slots: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        flat: FlatBatch,
    ) -> list[ImageSlice]:
        """The step's rows that take image embeddings (prompt chunks through image spans)."""
        slices: list[ImageSlice] = []
        if self.image_token_id is None:
            return slices  # a text model's steps: no per-request walk
        for row, request_id in enumerate(request_ids):
            images = self._requests[request_id].images
            start = int(num_computed[row])
            if not images or start >= images[-1].end:
                continue
            try:
                slices += image_slices(
                    request_id,
                    images,
                    self._token_ids[slots[row]],
                    start,
                    int(num_scheduled[row]),
                    int(flat.query_start_loc[row]),
                    self.image_token_id,
                )
            except ValueError as exc:
                raise InvalidPlanError(str(exc)) from None
        return slices

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
        request_ids: list[str],
        num_known: np.ndarray,
        slots: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> None:
        problem = schedule_problem(num_computed, num_scheduled, num_known, self._num_slots(slots))
        if problem is None and self._drafts:
            seq_lens = num_computed + num_scheduled
            for row, request_id in enumerate(request_ids):
                if request_id in self._drafts and seq_lens[row] != num_known[row]:
                    problem = row, "verifies proposals but does not schedule all of them"
                    break
        if problem is not None:
            row, message = problem
            raise InvalidPlanError(f"plan for request {request_ids[row]!r} {message}")

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
            ks.append(self.sampling_params(request_id).prompt_logprobs)
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

    def _num_slots(self, slots: np.ndarray) -> np.ndarray:
        """KV slots in each slot's block table [S]."""
        return self._num_positions[slots] * self.block_size

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
            self._block_tables,
            self._num_positions,
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
