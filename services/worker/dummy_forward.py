"""A forward pass at the largest step the scheduler may plan, for memory profiling."""

from __future__ import annotations

import torch

from pagestream_kernels.attention_metadata import AttentionMetadata
from services.worker.models.causal_lm import CausalLM
from services.worker.parallel_state import get_rank_info


@torch.inference_mode()
def dummy_forward(
    model: CausalLM, num_tokens: int, num_seqs: int, block_size: int, device: torch.device
) -> torch.Tensor | None:
    """Run num_tokens prompt tokens split over num_seqs sequences through a scratch cache.

    Returns the logits of each sequence's last token ([num_seqs, vocab]), so the peak
    includes the logits the sampler sees (a pipeline stage before the last returns its
    hidden states). Every rank of a worker group runs it at the same time (collectives).
    """
    num_seqs = max(1, min(num_seqs, num_tokens))
    seq_lens = torch.full((num_seqs,), num_tokens // num_seqs, dtype=torch.int32)
    seq_lens[: num_tokens % num_seqs] += 1  # [num_seqs]
    blocks_per_seq = -(-int(seq_lens.max()) // block_size)
    spec = model.kv_cache_spec
    kv_caches = [
        torch.zeros(
            spec.layer_shape(num_seqs * blocks_per_seq, block_size), dtype=spec.dtype, device=device
        )
        for _ in range(spec.num_layers)
    ]
    block_table = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, -1)
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), seq_lens.long())  # [num_tokens]
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(seq_lens, 0)
    positions = torch.arange(num_tokens) - query_start_loc[seq_ids].long()  # [num_tokens]
    slots = block_table[seq_ids, positions // block_size].long() * block_size
    slot_mapping = slots + positions % block_size  # [num_tokens]
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_table=block_table.to(device),
        seq_lens=seq_lens.to(device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=int(seq_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    rank = get_rank_info()
    extra = {}
    if not rank.is_first_stage:  # stand in for the previous stage's output
        size = (num_tokens, model.config.hidden_size)
        extra["hidden_states"] = torch.zeros(size, dtype=spec.dtype, device=device)
    hidden = model(input_ids, positions.to(device), kv_caches, metadata, **extra)
    if not rank.is_last_stage:
        return hidden  # [num_tokens, hidden]
    last_rows = (query_start_loc[1:] - 1).long().to(device)
    return model.compute_logits(hidden[last_rows])
