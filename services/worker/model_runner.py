"""ModelRunner: one plan -> one forward pass over the flattened batch -> sampled tokens."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from services.common.rank_info import RankInfo
from services.common.runner_output import RunnerOutput, StepTimings, TokenLogprobs
from services.common.scheduler_output import SchedulerOutput
from services.worker.cache_engine import CacheEngine
from services.worker.input_batch import InputBatch, InvalidPlanError
from services.worker.kv_offload.kv_offload_store import KVOffloadStore
from services.worker.lora.lora_manager import LoRAManager
from services.worker.models.causal_lm import CausalLM
from services.worker.multimodal.encoder_cache import EncoderCache
from services.worker.parallel_state import StageLink
from services.worker.pooler import Pooler
from services.worker.sampler import LogprobsTensors, Sampler, compute_token_logprobs
from services.worker.spec_decode.proposer import Proposer
from services.worker.spec_decode.rejection_sampler import accept_proposals
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
        proposer: Proposer | None = None,
        lora: LoRAManager | None = None,
        pooler: Pooler | None = None,
    ) -> None:
        self.model = model
        self.pooler = pooler  # the pooling runner's (services/worker/pooler.py), else None
        self.lora = lora  # the LoRA adapters' slots (services/worker/lora), None when off
        self.cache_engine = cache_engine
        self.proposer = proposer  # speculative decoding's proposals (services/worker/spec_decode)
        self.input_batch = input_batch
        self.sampler = sampler
        self.rank = rank or RankInfo()
        self.link = StageLink()
        self.encoder_cache = EncoderCache()  # image encoder outputs (vision-language models)
        self.kv_offload: KVOffloadStore | None = None  # KV offload tiers (set by the worker)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """One step. In a worker group every rank runs every plan; stages pass hidden
        states on, and only the output rank samples (the others return no tokens). The
        KV offload tiers' loads land before the forward, its saves copy out after it."""
        start = time.perf_counter()
        failed = self._offload_before(plan)
        output = self._step(plan, start)
        if self.kv_offload is not None:
            self.kv_offload.save(plan.kv_saves)
        if failed:
            output = dataclasses.replace(output, kv_load_failures=failed)
        return output

    def _offload_before(self, plan: SchedulerOutput) -> list[bytes]:
        """The plan's kv_drops then kv_loads (after its swaps and copies: a block swapped
        out this step may be a load's target); the keys that could not be loaded."""
        self._move_blocks(plan)
        if self.kv_offload is None:
            if plan.kv_loads:
                return [key for key, _ in plan.kv_loads]  # no tiers here: nothing to read
            return []
        self.kv_offload.drop(plan.kv_drops)
        return self.kv_offload.load(plan.kv_loads)

    def _step(self, plan: SchedulerOutput, start: float) -> RunnerOutput:
        self.input_batch.update(plan)
        for request_id in plan.finished_req_ids:
            self.encoder_cache.drop(request_id)
        if plan.total_num_scheduled_tokens == 0:
            return RunnerOutput(timings=StepTimings(prepare_s=time.perf_counter() - start))
        inputs = self.input_batch.prepare(plan, with_sampling=self.rank.is_output_rank)
        errors = {}
        if self.lora is not None:
            errors = self.lora.prepare(plan, inputs.request_ids, inputs.query_start_loc_host)
        prepared = time.perf_counter()
        hidden = self._forward(inputs)  # [num_tokens, hidden_size]
        forwarded = time.perf_counter()
        if not self.rank.is_last_stage:
            self.link.send(hidden)
            return RunnerOutput(timings=StepTimings(prepared - start, forwarded - prepared))
        sampled, logprobs = self._sample(hidden, inputs)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_logprobs)
        spec_token_ids = self._propose(plan, inputs, sampled)
        pooled, pool_errors = self._pool(hidden, inputs)
        done = time.perf_counter()
        return RunnerOutput(
            request_ids=inputs.request_ids,
            sampled_token_ids=[sampled.get(rid, []) for rid in inputs.request_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            timings=StepTimings(prepared - start, forwarded - prepared, done - forwarded),
            spec_token_ids=spec_token_ids,
            request_errors={**errors, **pool_errors},
            pooled=pooled,
        )

    def _pool(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The final pooled vectors of the pooling requests whose prompt ends this step,
        and the requests whose chunk could not be pooled (only the output rank pools)."""
        if inputs.pooling is None or not self.rank.is_output_rank:
            return {}, {}
        if self.pooler is None:
            raise InvalidPlanError("the plan has pooling requests, but this worker generates")
        return self.pooler.pool(hidden, inputs.pooling)

    def _propose(
        self, plan: SchedulerOutput, inputs: StepInputs, sampled: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        """Speculative proposals for the sequences that sampled (none for beam search, and
        none while the step runs disable_by_batch_size sequences or more); a draft model
        also catches up on this step's tokens here, proposing or not."""
        if self.proposer is None or not self.rank.is_output_rank:
            return {}
        proposing = []
        if len(inputs.request_ids) < self.proposer.config.disable_by_batch_size:
            proposing = [
                rid
                for rid in inputs.sampling_request_ids
                if rid in sampled and not self.input_batch.sampling_params(rid).use_beam_search
            ]
        return self.proposer.propose(self.input_batch, plan, proposing)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        extra = {}
        if not self.rank.is_first_stage:  # the previous stage's output, in plan order
            shape = (inputs.num_tokens, self.model.text_config.hidden_size)
            dtype = getattr(self.model, "hidden_dtype", self.model.dtype)
            extra["hidden_states"] = self.link.recv(shape, dtype, self.model.device)
        elif inputs.images:
            extra["inputs_embeds"] = self._inputs_embeds(inputs)
        kv_caches = self.cache_engine.layer_caches
        metadata = inputs.attention_metadata()
        return self.model(inputs.input_ids, inputs.positions, kv_caches, metadata, **extra)

    def _inputs_embeds(self, inputs: StepInputs) -> torch.Tensor:
        """The tokens' embeddings [T, hidden] with the image rows taking their images'
        encoder outputs (encoded on first need, kept until the span is prefilled)."""
        embeds = self.model.embed(inputs.input_ids)  # [T, hidden]
        cache = self.encoder_cache
        for piece in inputs.images:
            output = cache.get(piece.request_id, piece.image, self.model.encode_image)
            rows = torch.from_numpy(piece.rows).to(embeds.device)
            index = torch.from_numpy(piece.embed_index).to(output.device)
            embeds[rows] = output[index].to(embeds.device, embeds.dtype)
        for piece in inputs.images:  # after every use: equal images in one step encode once
            if piece.done:
                cache.release(piece.request_id, piece.image.content_hash)
        return embeds

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        """Swaps and copies before the forward pass writes into any of these blocks (in
        the draft model's cache too: it lives in the same block tables)."""
        engines = [self.cache_engine]
        if self.proposer is not None and self.proposer.cache_engine is not None:
            engines.append(self.proposer.cache_engine)
        for engine in engines:
            if plan.blocks_to_swap_out:
                engine.swap_out(plan.blocks_to_swap_out)
            if plan.blocks_to_swap_in:
                engine.swap_in(plan.blocks_to_swap_in)
            if plan.blocks_to_copy:
                engine.copy_blocks(plan.blocks_to_copy)

    def _sample(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        if not len(inputs.sampling_request_ids):
            return {}, {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [R, vocab]
        if logits is None or inputs.sampling_metadata is None:
            return {}, {}  # a tensor-parallel rank that does not sample
        out = self.sampler(logits, inputs.sampling_metadata)  # one token per verified position
        request_ids = inputs.sampling_request_ids
        token_ids, first_rows = accept_proposals(
            out.sampled_token_ids.tolist(), request_ids, inputs.draft_token_ids
        )
        self.input_batch.append_sampled(request_ids, token_ids)
        sampled = dict(zip(request_ids, token_ids, strict=True))
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if out.logprobs is not None:
            for rid, first, kept in zip(request_ids, first_rows, token_ids, strict=True):
                k = self.input_batch.sampling_params(rid).logprobs
                if k is not None:
                    rows = range(first, first + len(kept))
                    logprobs[rid] = [_to_token_logprobs(out.logprobs, row, k) for row in rows]
        return sampled, logprobs

    def _prompt_logprobs(
        self, hidden: torch.Tensor, spec: PromptLogprobsInputs | None
    ) -> dict[str, list[TokenLogprobs | None]]:
        if spec is None:
            return {}
        tensors = self._prompt_logprobs_tensors(hidden, spec)
        if tensors is None:
            return {}
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

    def _prompt_logprobs_tensors(
        self, hidden: torch.Tensor, spec: PromptLogprobsInputs
    ) -> LogprobsTensors | None:
        """The prompt rows' logprobs [Np, k + 1], their logits computed max_num_seqs rows at
        a time (the [max_num_seqs, vocab] logits the memory profile counts for sampling): a
        long prompt's chunk (up to max_num_batched_tokens rows) never holds [Np, vocab]
        float32 logits and their log_softmax at once. Every rank computes every slice
        (tensor-parallel logits gather across ranks); only the output rank keeps them."""
        parts, step = [], self.input_batch.max_num_seqs
        for start in range(0, len(spec.token_indices), step):
            rows = slice(start, start + step)
            logits = self.model.compute_logits(hidden[spec.token_indices[rows]])  # [rows, V]
            if logits is None or not self.rank.is_output_rank:
                continue
            parts.append(
                compute_token_logprobs(logits, spec.target_ids[rows], spec.max_num_logprobs)
            )
        if not parts:
            return None
        return LogprobsTensors(
            token_ids=torch.cat([p.token_ids for p in parts]),
            logprobs=torch.cat([p.logprobs for p in parts]),
            ranks=torch.cat([p.ranks for p in parts]),
        )
