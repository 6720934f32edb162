"""ModelRunner: one plan -> one forward pass over the flattened batch -> sampled tokens."""

from __future__ import annotations

import time

import torch

from kernels.attention_metadata import AttentionMetadata
from services.common.rank_info import RankInfo
from services.common.runner_output import RunnerOutput, StepTimings, TokenLogprobs
from services.common.scheduler_output import SchedulerOutput
from services.worker.cache_engine import CacheEngine
from services.worker.input_batch import InputBatch
from services.worker.models.causal_lm import CausalLM
from services.worker.parallel_state import StageLink
from services.worker.sampler import LogprobsTensors, Sampler, compute_token_logprobs
from services.worker.step_inputs import PromptLogprobsInputs, StepInputs


def _to_token_logprobs(tensors: LogprobsTensors, row: int, k: int) -> TokenLogprobs:
    """Row `row` as TokenLogprobs, keeping the chosen token and this request's own top-k."""
    return TokenLogprobs(
        token_ids=tensors.token_ids[row, : k + 1].tolist(),
        logprobs=tensors.logprobs[row, : k + 1].tolist(),
        ranks=tensors.ranks[row, : k + 1].tolist(),
    )


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache_engine: CacheEngine,
        input_batch: InputBatch,
        sampler: Sampler,
        rank: RankInfo | None = None,
    ) -> None:
        self.model = model
        self.cache_engine = cache_engine
        self.input_batch = input_batch
        self.sampler = sampler
        self.rank = rank or RankInfo()
        self.link = StageLink()

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """One step. In a worker group every rank runs every plan; stages pass hidden
        states on, and only the output rank samples (the others return no tokens)."""
        start = time.perf_counter()
        self._move_blocks(plan)
        self.input_batch.update(plan)
        if plan.total_num_scheduled_tokens == 0:
            return RunnerOutput(timings=StepTimings(prepare_s=time.perf_counter() - start))
        inputs = self.input_batch.prepare(plan, with_sampling=self.rank.is_output_rank)
        prepared = time.perf_counter()
        hidden = self._forward(inputs)  # [num_tokens, hidden_size]
        forwarded = time.perf_counter()
        if not self.rank.is_last_stage:
            self.link.send(hidden)
            return RunnerOutput(timings=StepTimings(prepared - start, forwarded - prepared))
        sampled, logprobs = self._sample(hidden, inputs)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_logprobs)
        done = time.perf_counter()
        return RunnerOutput(
            request_ids=inputs.request_ids,
            sampled_token_ids=[sampled.get(rid, []) for rid in inputs.request_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            timings=StepTimings(prepared - start, forwarded - prepared, done - forwarded),
        )

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        extra = {}
        if not self.rank.is_first_stage:  # the previous stage's output, in plan order
            shape = (len(inputs.positions), self.model.text_config.hidden_size)
            dtype = getattr(self.model, "hidden_dtype", self.model.dtype)
            extra["hidden_states"] = self.link.recv(shape, dtype, self.model.device)
        kv_caches = self.cache_engine.kv_caches
        return self.model(inputs.input_ids, inputs.positions, kv_caches, _metadata(inputs), **extra)

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        """Swaps and copies before the forward pass writes into any of these blocks."""
        if plan.blocks_to_swap_out:
            self.cache_engine.swap_out(plan.blocks_to_swap_out)
        if plan.blocks_to_swap_in:
            self.cache_engine.swap_in(plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            self.cache_engine.copy_blocks(plan.blocks_to_copy)

    def _sample(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        if not len(inputs.sampling_request_ids):
            return {}, {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [R, vocab]
        if logits is None or inputs.sampling_metadata is None:
            return {}, {}  # a tensor-parallel rank that does not sample
        out = self.sampler(logits, inputs.sampling_metadata)
        token_ids = [[t] for t in out.sampled_token_ids.tolist()]
        self.input_batch.append_sampled(inputs.sampling_request_ids, token_ids)
        sampled = dict(zip(inputs.sampling_request_ids, token_ids, strict=True))
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if out.logprobs is not None:
            for row, rid in enumerate(inputs.sampling_request_ids):
                k = self.input_batch.sampling_params(rid).logprobs
                if k is not None:
                    logprobs[rid] = [_to_token_logprobs(out.logprobs, row, k)]
        return sampled, logprobs

    def _prompt_logprobs(
        self, hidden: torch.Tensor, spec: PromptLogprobsInputs | None
    ) -> dict[str, list[TokenLogprobs | None]]:
        if spec is None:
            return {}
        logits = self.model.compute_logits(hidden[spec.token_indices])  # [Np, vocab]
        if logits is None or not self.rank.is_output_rank:
            return {}
        tensors = compute_token_logprobs(logits, spec.target_ids, spec.max_num_logprobs)
        result: dict[str, list[TokenLogprobs | None]] = {}
        row = 0
        for rid, num_rows, first, k in zip(
            spec.request_ids, spec.num_rows, spec.first_positions, spec.num_logprobs, strict=True
        ):
            entries: list[TokenLogprobs | None] = [None] if first == 1 else []
            entries += [_to_token_logprobs(tensors, r, k) for r in range(row, row + num_rows)]
            result[rid] = entries
            row += num_rows
        return result


def _metadata(inputs: StepInputs) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        block_table=inputs.block_table,
        seq_lens=inputs.seq_lens,
        query_start_loc=inputs.query_start_loc,
        max_query_len=inputs.max_query_len,
        max_seq_len=inputs.max_seq_len,
    )
