"""Scheduler: V1-style token budget over running, swapped and waiting requests.

Every request gets min(remaining, budget) tokens a step (chunked prefill, prefix hits,
resumes alike): running first (preempting the newest when blocks run out), then swapped,
then waiting in FCFS (or priority) order. A request is in flight from schedule() until its
step's output is processed: it is never scheduled again nor preempted (the worker writes
its blocks), nor is another member of its sequence group, so forks never race a step.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from services.common.config import CacheConfig, SchedulerConfig
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from services.common.pooler_config import PoolerConfig
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.admission import (
    RequestRejectedError,
    check_overload,
    enqueue_waiting,
    validate_request,
)
from services.scheduler.encoder_budget import fit_chunk, images_to_encode
from services.scheduler.in_flight import StepsInFlight
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.lora_slot_table import LoRASlotTable
from services.scheduler.plan_builder import PlanBuilder
from services.scheduler.request import Request, RequestStatus
from services.scheduler.sequence_groups import SequenceGroups
from services.scheduler.spec_decode_stats import SpecDecodeStats
from services.scheduler.stop_checker import check_stop
from services.scheduler.structured_output_manager import StructuredOutputManager

logger = logging.getLogger(__name__)

__all__ = ["RequestRejectedError", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_device_blocks: int,
        num_cpu_blocks: int = 0,
        structured: StructuredOutputManager | None = None,
        num_lookahead_tokens: int = 0,
        max_loras: int = 0,
        pooler: PoolerConfig | None = None,
    ) -> None:
        self.config = scheduler_config
        # The most prompt tokens of one request a step computes (the config is frozen).
        self.prefill_cap = _prefill_cap(scheduler_config)
        # Pooling: how the workers pool (None: the engine runs the generate runner and
        # pooling requests are refused); an encoder's prompts run whole, one step each.
        self.pooling_type = pooler.pooling_type if pooler is not None else None
        self.whole_prompts = pooler is not None and pooler.whole_prompt
        # LoRA: the workers' adapter slots (0: LoRA is off, adapters are refused).
        self.loras = LoRASlotTable(max_loras)
        # Speculative decoding with a draft model: KV slots each sequence keeps past its
        # scheduled tokens, where the draft writes while it proposes.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodeStats()
        # Grammars of constrained requests (None: such requests are refused).
        self.structured = structured or StructuredOutputManager(None, 0)
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            self.block_size,
            num_device_blocks,
            num_cpu_blocks,
            cache_config.enable_prefix_caching,
            cache_config.kv_cache_groups,
            # The most tokens one step computes for one sequence (0: a whole prompt).
            self.prefill_cap if scheduler_config.enable_chunked_prefill else 0,
        )
        # A sequence can never outgrow the whole cache (but for its blocks freed outside a
        # sliding window): that is a length cap too.
        self.max_model_len = scheduler_config.max_model_len
        if (longest := self.kv.longest_sequence()) is not None:
            self.max_model_len = min(self.max_model_len, longest)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.on_worker: set[str] = set()  # requests whose state the worker holds
        self.finished_req_ids: set[str] = set()  # to drop on the worker with the next plan
        # Finals not tied to a step (aborted, ignored), with their client ids.
        self.pending_outputs: list[tuple[int, EngineCoreOutput]] = []
        self.num_preemptions = 0
        self.pending_swap_out: list[tuple[int, int]] = []  # for the next plan
        self.groups = SequenceGroups(self)
        self.in_flight = StepsInFlight()
        # Requests holding a block whose KV offload load failed (request_id -> its first
        # position computed from garbage): recomputed when not in flight.
        self.poisoned: dict[str, int] = {}

    # ---- admission -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        validate_request(request, self.requests, self.config, self.kv)
        if request.lora_request is not None and not self.loras.max_loras:
            raise RequestRejectedError(
                f"the request asks for the LoRA adapter {request.lora_request.lora_name!r}, "
                "but LoRA is not enabled (start the engine with --enable-lora)."
            )
        self._check_pooling(request)
        check_overload(len(self.waiting), self.config.max_waiting_requests)
        if request.block_size != self.block_size:
            request.block_size = self.block_size
            request.block_hashes = []
            request.update_block_hashes()
        if request.uses_beam_search:
            self.groups.add_beam_request(request, self.max_model_len)
        try:
            self.structured.admit(request)
        except ValueError as exc:
            raise RequestRejectedError(str(exc)) from exc
        self.requests[request.request_id] = request
        enqueue_waiting(self.waiting, request, self.config.policy)

    def _check_pooling(self, request: Request) -> None:
        if not request.is_pooling:
            return
        if self.pooling_type is None:
            raise RequestRejectedError(
                "this engine runs the generate runner: pooling requests (embeddings) need "
                "a pooling engine (--runner pooling)."
            )
        request.pools_every_position = self.pooling_type != "LAST" or self.whole_prompts
        if self.whole_prompts and request.num_prompt_tokens > self.prefill_cap:
            raise RequestRejectedError(
                f"the prompt has {request.num_prompt_tokens} tokens; an encoder attends over "
                "a whole prompt in one step, so it must fit max_num_batched_tokens "
                f"({self.prefill_cap})."
            )

    def abort_requests(self, request_ids: list[str], client_id: int | None = None) -> None:
        """Abort requests by id; a group's id (n > 1, beam search) aborts all its sequences.
        With `client_id`, only that client's: ids are one namespace across clients, and a
        client whose add was refused as "already in use" must not end another's request."""
        ids = set(request_ids)

        def owned(owner: int | None) -> bool:
            return client_id is None or owner == client_id

        for group_id in ids & set(self.groups.beam_groups):
            client = self.groups.beam_groups[group_id].client_id
            if owned(client):
                outputs = self.groups.abort_beam_group(group_id)
                self.pending_outputs += [(client, o) for o in outputs]
        targets = [
            r
            for r in self.requests.values()
            if (r.request_id in ids or r.group_id in ids) and owned(r.client_id)
        ]
        for request in targets:
            if request.is_finished:
                continue
            self._remove_from_queues(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self.pending_outputs.append((request.client_id, request.to_output([])))

    def retire(self, request: Request) -> None:
        """End a sequence silently (a pruned beam): its blocks go, the worker drops it."""
        self._remove_from_queues(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _remove_from_queues(self, request: Request) -> None:
        for queue in (self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        if request in self.running:
            self.running.remove(request)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's plan; every request in it is in flight until its output is processed."""
        budget = self.config.max_num_batched_tokens
        plan = PlanBuilder(token_budget=budget, encoder_budget=budget)
        kv_drops = self.kv.take_offload_drops()
        num_preemptions = self.num_preemptions
        stalled = self._schedule_running(plan)
        admit = self.num_preemptions == num_preemptions and not stalled
        if admit:
            self._schedule_swapped(plan)
        if admit and not self.swapped:
            self._schedule_waiting(plan)
        if not plan.scheduled and (self.waiting or self.swapped) and not self.in_flight.groups:
            self._unblock(plan)
        plan.blocks_to_swap_out = self.pending_swap_out
        masks = self.structured.masks(
            plan.scheduled, plan.num_scheduled_tokens, plan.spec_token_ids
        )
        loras = self.loras.assign(plan.scheduled, self.running)
        offload = (kv_drops, *self.kv.take_offload_transfers())
        output = plan.build(
            self.finished_req_ids, self.kv.take_pending_copies(), masks, loras, offload
        )
        self.finished_req_ids = set()
        self.pending_swap_out = []
        now = time.monotonic()
        for request in plan.scheduled:
            request.num_computed_tokens += plan.num_scheduled_tokens[request.request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.in_flight.take_off(request, output)
        return output

    def _num_new_tokens(self, num_new: int, is_prefill: bool, budget: int) -> int:
        """num_new within the step's budget and, for a prefill, the long-prefill cap."""
        return min(num_new, budget, self.prefill_cap if is_prefill else num_new)

    def _fit_images(self, plan: PlanBuilder, request: Request, start: int, num_new: int) -> int:
        """num_new cut so the images the chunk has the worker encode fit the step's encoder
        budget (encoder_budget.py); without chunked prefill a prompt is not cut: 0."""
        if not request.images or start >= request.num_prompt_tokens:
            return num_new
        fresh = request.request_id not in self.on_worker
        untouched = plan.encoder_budget == self.config.max_num_batched_tokens
        fitted, _ = fit_chunk(
            request.images, start, num_new, fresh, plan.encoder_budget, untouched, self.prefill_cap
        )
        if fitted < num_new and not self.config.enable_chunked_prefill:
            return 0
        return fitted

    def _schedule_running(self, plan: PlanBuilder) -> bool:
        """Schedule running requests in order; True if one ran out of blocks (it preempted
        itself, or it waits for newer requests whose steps are in flight)."""
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            index += 1
            if self.is_blocked(request):
                continue
            if request.pending_fork and request.num_tokens_to_compute == 0:
                self.groups.fork(request)
            num_new = self._num_new_tokens(
                request.num_tokens_to_compute, request.is_prefill, plan.token_budget
            )
            num_new = self._fit_images(plan, request, request.num_computed_tokens, num_new)
            if num_new == 0:
                continue
            drafts = self._drafts_to_verify(request, plan.token_budget)
            num_new += len(drafts)
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:
                return True  # everything after it is gone or in flight
            self._add_to_plan(plan, request, new_blocks, num_new, drafts=drafts)
        return False

    def _drafts_to_verify(self, request: Request, token_budget: int) -> list[int]:
        """The request's proposals (consumed) that this step verifies: only for a decoding
        sequence, within the budget, never past max_tokens or max_model_len (so a step's
        tokens all fit), and with a grammar only the prefix the grammar allows."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or request.num_tokens_to_compute != 1:
            return []
        room = min(token_budget, self.max_model_len - request.num_tokens) - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        drafts = drafts[: max(room, 0)]
        return self.structured.valid_prefix(request, drafts) if drafts else []

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots past the scheduled tokens for the draft model, within max_model_len."""
        end = request.num_computed_tokens + num_new
        return max(min(self.num_lookahead_tokens, self.max_model_len - end), 0)

    def _allocate_or_preempt(self, request: Request, num_new: int):
        """Blocks for the request, preempting the newest running requests not in flight;
        None if it preempted itself or must wait for newer requests' steps to land."""
        lookahead = self._lookahead(request, num_new)
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is not None:
                return new_blocks
            victim = next(r for r in reversed(self.running) if not r.in_flight)
            if victim is request and self.running[-1] is not request:
                return None  # only in-flight requests are newer: wait for their steps
            self._preempt(victim)
            if victim is request:
                return None

    def _add_to_plan(
        self,
        plan: PlanBuilder,
        request: Request,
        new_blocks,
        num_new: int,
        replace=False,
        drafts: list[int] | None = None,
    ) -> None:
        rid = request.request_id
        rewritten = self.kv.take_rewritten(rid)
        if request.images:
            start, fresh = request.num_computed_tokens, rid not in self.on_worker
            encoded = images_to_encode(request.images, start, num_new, fresh)
            plan.encoder_budget -= sum(image.num_embeds for image in encoded)
        if rid not in self.on_worker:
            self.on_worker.add(rid)
            plan.add_new(request, self.kv.block_table(rid), num_new)
        elif replace or rewritten:
            plan.add_cached(request, self.kv.block_table(rid), num_new, replace_table=True)
        else:
            plan.add_cached(request, new_blocks, num_new)
        if drafts:
            plan.spec_token_ids[rid] = drafts

    def _preempt(self, victim: Request, mode: str | None = None) -> None:
        """Free the victim's device blocks: swap them to the CPU pool or drop them.

        The victim must not be in flight (the worker may still be writing its blocks)."""
        assert not victim.in_flight, f"{victim.request_id} has a step in flight"
        self.running.remove(victim)
        self.num_preemptions += 1
        mapping = None
        # Only what has tokens to compute is swapped: a group's parent that finished its
        # prefill but has not forked yet (or a beam waiting for its siblings) would come
        # back with nothing to schedule (a plan row of 0 tokens, which the worker refuses
        # beside other rows); it is recomputed instead.
        if (mode or self.config.preemption_mode) == "swap" and victim.num_tokens_to_compute:
            mapping = self.kv.swap_out(victim)
        if mapping is not None:
            self.pending_swap_out.extend(mapping)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            logger.debug("swapped out %s (%d blocks)", victim.request_id, len(mapping))
            return
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        self._drop_from_worker(victim)
        self.waiting.appendleft(victim)
        logger.debug("preempted %s for recompute", victim.request_id)

    def _unblock(self, plan: PlanBuilder) -> None:
        """Nothing ran, nothing is in flight, yet requests wait: free the blocks of running
        sequences that have nothing to compute (beams waiting for their siblings) so the
        queue can move."""
        stalled = [r for r in self.running if r.num_tokens_to_compute == 0 and not r.pending_fork]
        while stalled and not plan.scheduled:
            self._preempt(stalled.pop(), mode="recompute")
            self._schedule_swapped(plan)
            if not self.swapped:
                self._schedule_waiting(plan)

    def _schedule_swapped(self, plan: PlanBuilder) -> None:
        while self.swapped and plan.token_budget > 0:
            request = self.swapped[0]
            if len(self.running) >= self.config.max_num_seqs or self.is_blocked(request):
                return
            if not self.loras.fits(request, self.running):
                return  # its adapter would be one too many: it waits for a slot
            num_new = self._num_new_tokens(
                request.num_tokens_to_compute, request.is_prefill, plan.token_budget
            )
            num_new = self._fit_images(plan, request, request.num_computed_tokens, num_new)
            if num_new == 0:
                return
            mapping = self.kv.swap_in(request, num_new)
            if mapping is None:
                return
            self.swapped.popleft()
            plan.blocks_to_swap_in.extend(mapping)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_plan(plan, request, [], num_new, replace=True)

    def _schedule_waiting(self, plan: PlanBuilder) -> None:
        """Admit the head of the waiting queue while the budget, max_num_seqs and free
        blocks allow. A request whose grammar still compiles, or whose LoRA adapter would
        be one more than max_loras, is passed over (others go first) and put back at the
        head afterwards; one that can never fit, or whose grammar failed, ends here with
        its final output."""
        passed_over: list[Request] = []
        try:
            while self.waiting and plan.token_budget > 0:
                request = self.waiting[0]
                if (status := self.structured.gate(request)) is not None:
                    if status.is_finished:  # its grammar failed, or allows only EOS
                        self._finish_waiting(status)
                    else:  # still compiling: others go first
                        passed_over.append(self.waiting.popleft())
                    continue
                if not self.loras.fits(request, self.running):
                    passed_over.append(self.waiting.popleft())
                    continue
                if len(self.running) + request.num_sequences > self.config.max_num_seqs:
                    return
                if self.is_blocked(request):
                    return  # a sibling's step is in flight: the queue moves next step
                if self.kv.peak_blocks(request.num_tokens) > self.kv.num_blocks:
                    self._finish_waiting(RequestStatus.FINISHED_IGNORED)
                    continue
                if not self._admit(request, plan):
                    return
        finally:
            self.waiting.extendleft(reversed(passed_over))

    def _finish_waiting(self, status: RequestStatus) -> None:
        """End the head of the waiting queue (its final output goes with the next step)."""
        request = self.waiting.popleft()
        self._finish(request, status)
        self.pending_outputs.append((request.client_id, request.to_output([])))

    def _admit(self, request: Request, plan: PlanBuilder) -> bool:
        computed_blocks, num_hit = self.kv.get_computed_blocks(request)
        target = request.num_prompt_tokens - 1 if request.pending_fork else request.num_tokens
        num_new = max(target - num_hit, 0)
        if not self.config.enable_chunked_prefill and num_new > plan.token_budget:
            return False  # strict FCFS: nothing behind it may overtake
        whole = num_new
        num_new = self._num_new_tokens(num_new, True, plan.token_budget)
        if self.whole_prompts and num_new < whole:
            return False  # an encoder's prompt runs whole: it waits for a step with room
        if whole and not (num_new := self._fit_images(plan, request, num_hit, num_new)):
            return False  # its first image waits for a step with encoder budget
        lookahead = self._lookahead(request, num_new + num_hit)
        num_loaded = num_hit // self.block_size - len(computed_blocks[0])  # the tiers' part
        new_blocks = self.kv.allocate_slots(
            request, num_new, computed_blocks, lookahead, num_loaded
        )
        if new_blocks is None:
            return False
        self.waiting.popleft()
        self.kv.record_prefix_query(request.num_tokens, num_hit)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if num_new:
            self._add_to_plan(plan, request, new_blocks, num_new)
        return True

    # ---- results -------------------------------------------------------------------
    def update_from_output(
        self, plan: SchedulerOutput, runner_output: RunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs: dict[int, list[EngineCoreOutput]] = {}
        for client_id, output in self.pending_outputs:
            outputs.setdefault(client_id, []).append(output)
        self.pending_outputs = []
        landed = self.in_flight.land(plan, self.requests)
        if plan.kv_loads or runner_output.kv_load_failures:
            self._land_loads(plan, runner_output.kv_load_failures)
        for rid, token_ids in zip(
            runner_output.request_ids, runner_output.sampled_token_ids, strict=True
        ):
            request = landed.get(rid)
            if request is None or request.is_finished:
                continue  # aborted while its step ran (its id may be in use again)
            if rid in self.poisoned:
                continue  # its step read a failed load: recomputed below, outputs dropped
            if rid in runner_output.request_errors:
                self._fail(request, runner_output.request_errors[rid])
                outputs.setdefault(request.client_id, []).append(request.to_output([]))
                continue
            if request.is_pooling:
                if (output := self._pooling_output(request, runner_output.pooled)) is not None:
                    outputs.setdefault(request.client_id, []).append(output)
                continue
            try:
                new_outputs = self._request_outputs(request, token_ids, plan, runner_output)
            except Exception:
                # One request's bad state must not take the engine down for everyone else.
                logger.exception("aborting %s: processing its step output failed", rid)
                self.abort_requests([request.group_id])
                continue
            outputs.setdefault(request.client_id, []).extend(new_outputs)
        self._recompute_poisoned()
        self.running = [r for r in self.running if not r.is_finished]
        stats = self.get_stats()
        return {c: EngineCoreOutputs(outs, stats) for c, outs in outputs.items()}

    def _land_loads(self, plan: SchedulerOutput, failures: list[bytes]) -> None:
        """The plan's kv_loads landed; the worker could not read `failures`: the caches
        forget them and what was computed after them (KVCacheManager.land_loads), and
        every request holding a block they were to fill (its own load, or a device hit on
        it since) is recomputed from scratch."""
        bad = self.kv.land_loads(plan.kv_loads, failures)
        if not failures:
            return
        logger.warning("%d KV offload loads failed: recomputing what they held", len(failures))
        for request in self.running:
            first = self.kv.first_position_of(request, bad)
            if first is not None:
                self.kv.discard_from(request, first)
                self.poisoned[request.request_id] = first

    def _recompute_poisoned(self) -> None:
        """Preempt by recompute the poisoned requests no step holds (the others when
        their step lands; their outputs of that step are dropped)."""
        for rid, first in list(self.poisoned.items()):
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                del self.poisoned[rid]
            elif not request.in_flight and request in self.running:
                self.kv.discard_from(request, first)
                del self.poisoned[rid]
                self._preempt(request, mode="recompute")

    def _request_outputs(
        self,
        request: Request,
        token_ids: list[int],
        plan: SchedulerOutput,
        runner_output: RunnerOutput,
    ) -> list[EngineCoreOutput]:
        if request.beam_group is not None:
            logprobs = runner_output.logprobs.get(request.request_id)
            return self.groups.on_beam_output(request, logprobs)
        output = self._process_tokens(request, token_ids, plan, runner_output)
        return [] if output is None else [output]

    def _process_tokens(
        self,
        request: Request,
        token_ids: list[int],
        plan: SchedulerOutput,
        runner_output: RunnerOutput,
    ) -> EngineCoreOutput | None:
        rid = request.request_id
        prompt_logprobs = runner_output.prompt_logprobs.get(rid)
        drafts = plan.scheduled_spec_decode_tokens.get(rid)
        if drafts:
            self._roll_back_rejected(request, drafts, token_ids)
        if not token_ids and prompt_logprobs is None:
            return None
        new_ids: list[int] = []
        status = None
        for token_id in token_ids:
            request.append_output_token_ids([token_id])
            new_ids.append(token_id)
            status = self.structured.accept(request, token_id) or check_stop(
                request, self.max_model_len
            )
            if status is not None:
                break
        if status is not None:
            self._finish(request, status)
        else:
            request.spec_token_ids = runner_output.spec_token_ids.get(rid, [])
        logprobs = runner_output.logprobs.get(rid)
        if logprobs is not None and len(logprobs) > len(new_ids):
            logprobs = logprobs[: len(new_ids)]  # it stopped inside an accepted run
        return request.to_output(new_ids, logprobs, prompt_logprobs)

    def _pooling_output(self, request: Request, pooled: dict) -> EngineCoreOutput | None:
        """A pooling request ends with the final pooled vector the worker sends once, in
        the step that ends its prompt (pooled, headed, truncated and normalized there: the
        scheduler only forwards it); a prompt done without one is an error."""
        vector = pooled.get(request.request_id)
        if vector is not None:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            return request.to_output([], pooled=vector)
        if request.is_prefill:
            return None  # more of its prompt to run
        request.error = "the workers returned no pooled vector for the request's prompt"
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return request.to_output([])

    def _roll_back_rejected(self, request: Request, drafts: list[int], token_ids: list[int]):
        """The step verified `drafts` and kept len(token_ids) - 1 of them (then the target's
        own token): the rejected ones' KV is not the sequence's, so num_computed_tokens goes
        back over them and the blocks only they touched are freed."""
        num_accepted = len(token_ids) - 1
        if (
            not 0 <= num_accepted <= len(drafts)
            or token_ids[:num_accepted] != drafts[:num_accepted]
        ):
            raise ValueError(
                f"the worker returned {token_ids} for the proposals {drafts} of "
                f"{request.request_id}: not an accepted prefix plus one token"
            )
        self.spec_stats.observe(len(drafts), num_accepted)
        request.num_computed_tokens -= len(drafts) - num_accepted
        self.kv.trim(request)

    def is_blocked(self, request: Request) -> bool:
        """It, or a sequence of its group, has a step in flight: not schedulable now."""
        return self.in_flight.blocks(request)

    def _fail(self, request: Request, error: str) -> None:
        """End a request whose step the worker could not run as asked; the blocks that step
        wrote are wrong, so they leave the prefix cache."""
        request.error = error
        self.kv.uncache(request)
        self._finish(request, RequestStatus.FINISHED_ERROR)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.in_flight.clear(request)
        self.kv.free(request)
        self._drop_from_worker(request)
        self.requests.pop(request.request_id, None)

    def _drop_from_worker(self, request: Request) -> None:
        if request.request_id in self.on_worker:
            self.on_worker.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    # ---- introspection -------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def has_pending_outputs(self) -> bool:
        return bool(self.pending_outputs)

    def has_schedulable_requests(self) -> bool:
        """Whether schedule() may find work not blocked by steps in flight (a cheap guess:
        waiting or swapped requests may still not fit)."""
        if self.waiting or self.swapped:
            return True
        return any(
            not self.is_blocked(r) and (r.num_tokens_to_compute > 0 or r.pending_fork)
            for r in self.running
        )

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_swapped_reqs=len(self.swapped),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec_stats.accepted_per_pos),
            running_lora_adapters=_adapter_names(self.running),
            waiting_lora_adapters=_adapter_names([*self.waiting, *self.swapped]),
            max_lora=self.loras.max_loras,
            kv_offload_hits=self.kv.offload_hits,
            kv_offload_load_failures=self.kv.offload_failures,
        )


def _adapter_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request}))


def _prefill_cap(config: SchedulerConfig) -> int:
    """The most prompt tokens of one request a step computes: the long-prefill threshold
    (0: none) within the step's token budget. A step's remaining budget never exceeds
    max_num_batched_tokens, so capping by both is capping by the threshold alone."""
    threshold = config.long_prefill_token_threshold
    return min(config.max_num_batched_tokens, threshold or config.max_num_batched_tokens)
