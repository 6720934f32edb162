"""Other worker-group layouts give HF's greedy outputs: pipeline_parallel_size = 2 (two
stages of one layer each, hidden states sent stage to stage, two plans in flight),
tp = 2 x pp = 2 (four ranks) with n-gram speculative decoding (the output rank proposes,
the plan carries the proposals to every rank), and tp = 2 on a model with ONE KV head
(each rank keeps a replica of it). Mixed batches with chunked prefill, prefix hits and
preemption."""

import pytest

from pagestream import LLM
from tests.helpers.parallel import (
    assert_same_or_near_tie,
    generate_ids,
    greedy_params,
    mixed_prompts,
    set_preemption_mode,
)
from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.tiny_tokenizer import build_tokenizer

LAYOUTS = {
    "pp2": dict(pipeline_parallel_size=2),
    "tp2xpp2": dict(
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    ),
    "tp2-one-kv-head": dict(tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def one_kv_head_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-llama-1kv")
    build_tiny_model("llama", vocab_size=512, num_key_value_heads=1).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, model_dir, one_kv_head_dir):
    """(layout name, model folder, LLM) — one worker group per layout."""
    name = request.param
    folder = one_kv_head_dir if name == "tp2-one-kv-head" else model_dir("llama")
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        kv_cache_memory="16KiB",
        swap_space=0.01,
        max_num_batched_tokens=40,
        **LAYOUTS[name],
    )
    yield name, folder, llm
    llm.engine.close()


def test_the_group_describes_its_layout(layout):
    name, _, llm = layout
    info = llm.engine.model_info
    expected = LAYOUTS[name]
    assert info.tensor_parallel_size == expected.get("tensor_parallel_size", 1)
    assert info.pipeline_parallel_size == expected.get("pipeline_parallel_size", 1)
    assert info.world_size == info.tensor_parallel_size * info.pipeline_parallel_size
    in_flight = llm.engine.core.executor.max_concurrent_batches
    assert in_flight == info.pipeline_parallel_size  # pp plans in flight


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_outputs_match_hf(layout, hf_greedy, mode):
    _, folder, llm = layout
    set_preemption_mode(llm, mode)
    prompts = [p[:26] for p in mixed_prompts(9, seed=4)]
    params = greedy_params(len(prompts), max_tokens=7)
    preemptions = llm.engine.scheduler.num_preemptions
    got = generate_ids(llm, prompts, params)
    num_blocks = llm.engine.cache_info.num_device_blocks
    if num_blocks * 4 < 9 * 30:  # the batch cannot fit at once: preemption is certain
        assert llm.engine.scheduler.num_preemptions > preemptions
    assert llm.engine.scheduler.kv.num_free_blocks == num_blocks
    assert llm.engine.scheduler.get_stats().prefix_cache_hits > 0
    if "speculative_config" in LAYOUTS[layout[0]]:
        assert llm.engine.scheduler.get_stats().spec_decode_num_drafts > 0
    for prompt, sp, out in zip(prompts, params, got, strict=True):
        expected = hf_greedy(folder, prompt, sp.max_tokens)
        if 2 in expected:
            expected = expected[: expected.index(2) + 1]
        assert_same_or_near_tie(folder, prompt, out, expected)
