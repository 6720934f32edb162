"""Where ranks sit and what each holds: rank arithmetic, the pipeline's layer split, KV-head
split and replication, vocab-parallel shards, and the start-up checks that name the flag."""

import pytest
import torch
from transformers import LlamaConfig

from services.common.rank_info import RankInfo
from services.worker.layers.linear import QKVLinear, kv_heads_per_rank
from services.worker.layers.vocab_embedding import VocabEmbedding
from services.worker.models.llama import check_tensor_parallel, stage_layers


def test_rank_arithmetic_tp_major_within_a_stage():
    infos = [RankInfo(rank, tensor_parallel_size=2, pipeline_parallel_size=2) for rank in range(4)]
    assert [(i.pp_rank, i.tp_rank) for i in infos] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [i.is_output_rank for i in infos] == [False, False, True, False]
    assert [i.is_first_stage for i in infos] == [True, True, False, False]
    with pytest.raises(ValueError, match="rank must be in"):
        RankInfo(4, tensor_parallel_size=2, pipeline_parallel_size=2)


@pytest.mark.parametrize(("num_layers", "pp"), [(30, 4), (2, 2), (7, 3), (5, 1)])
def test_stages_split_the_layers_evenly_and_completely(num_layers, pp):
    stages = [stage_layers(num_layers, pp, r) for r in range(pp)]
    assert [i for stage in stages for i in stage] == list(range(num_layers))
    assert max(map(len, stages)) - min(map(len, stages)) <= 1


def test_more_stages_than_layers_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size .3. is larger than .* 2 layers"):
        stage_layers(2, 3, 0)


def test_head_checks_name_the_flag():
    config = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide .* 9"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 3)
    config = LlamaConfig(num_attention_heads=12, num_key_value_heads=3, hidden_size=576)
    with pytest.raises(ValueError, match="3 KV heads are neither divisible by it nor divide it"):
        check_tensor_parallel(config, 4)
    check_tensor_parallel(config, 6)  # 2 query heads per rank, KV heads replicated twice


def test_kv_heads_split_or_replicated():
    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(2, 4) == 1
    with pytest.raises(ValueError):
        kv_heads_per_rank(3, 2)


def test_fewer_kv_heads_than_ranks_replicates_them():
    """4 ranks, 2 KV heads: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1."""
    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim = 16, 4, 2, 4
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(3, hidden)
    for rank in range(4):
        layer = QKVLinear(hidden, head_dim, heads, kv_heads, tp_rank=rank, tp_size=4)
        for shard, weight in zip("qkv", (q, k, v), strict=True):
            layer.weight.weight_loader(layer.weight, weight, shard)
        q_out, k_out, v_out = layer.split(layer(x))
        kv_head = rank // 2
        rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        torch.testing.assert_close(q_out, x @ q[rank * head_dim : (rank + 1) * head_dim].T)
        torch.testing.assert_close(k_out, x @ k[rows].T)
        torch.testing.assert_close(v_out, x @ v[rows].T)


def test_fused_qkv_checkpoint_is_cut_per_rank():
    torch.manual_seed(1)
    hidden, heads, kv_heads, head_dim = 8, 4, 2, 2
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    fused, separate = (
        QKVLinear(hidden, head_dim, heads, kv_heads, tp_rank=1, tp_size=2) for _ in "ab"
    )
    fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]))
    for shard, weight in zip("qkv", (q, k, v), strict=True):
        separate.weight.weight_loader(separate.weight, weight, shard)
    torch.testing.assert_close(fused.weight, separate.weight)


def test_vocab_shards_cover_the_table_once():
    table = torch.randn(10, 3)
    shards = []
    for rank in range(3):
        layer = VocabEmbedding(10, 3, tp_rank=rank, tp_size=3)
        layer.weight.weight_loader(layer.weight, table)
        assert layer.weight.shape == (4, 3)
        shards.append(layer.weight.data)
    stacked = torch.cat(shards)
    torch.testing.assert_close(stacked[:10], table)
    assert stacked[10:].abs().sum() == 0  # the last shard's padding
