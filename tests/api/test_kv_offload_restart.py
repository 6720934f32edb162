"""KV offload tiers end to end (issue 52): a long prompt served, the LLM closed, a new LLM on
the same --kv-offload-dir reads the prompt's blocks back (cached tokens reported) and gives
HF's greedy tokens; a truncated file, a file of another model and a file corrupted after
the restart's scan are never used (the last is recomputed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagestream import LLM, SamplingParams
from services.common import kv_block_file
from services.common.block_hash import hash_request_tokens
from tests.helpers.tiny_models import random_tokens

BLOCK = 4
ENGINE = {"dtype": "float32", "block_size": BLOCK, "kv_cache_memory": "8MiB"}
PROMPT = [t % 200 + 3 for t in random_tokens(30, seed=52)]  # 7 full blocks, 2 tokens more
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _serve(folder: Path, root: Path, prompt=PROMPT, **extra):
    """One LLM on `root`: the prompt's output, then closed (its writes land)."""
    llm = LLM(str(folder), kv_offload_dir=str(root), enable_prefix_caching=True, **ENGINE, **extra)
    try:
        return llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    finally:
        llm.engine.close()


def _block_files(root: Path) -> dict[bytes, Path]:
    """Every block file under root, by key (one model's folder each)."""
    return {bytes.fromhex(p.stem): p for p in root.glob("*/*" + kv_block_file.SUFFIX)}


def _keys(prompt=PROMPT) -> list[bytes]:
    return hash_request_tokens(prompt, BLOCK)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_restart_reads_the_prompt_back(model_dir, hf_greedy, tmp_path, async_scheduling):
    folder = model_dir("llama")
    first = _serve(folder, tmp_path, async_scheduling=async_scheduling)
    assert first.num_cached_tokens == 0
    files = _block_files(tmp_path)
    assert set(_keys()[:7]) <= set(files)  # every full block of the prompt, saved
    again = _serve(folder, tmp_path, async_scheduling=async_scheduling)
    assert again.num_cached_tokens == 28  # 7 blocks, never the last token
    tokens = list(again.outputs[0].token_ids)
    assert tokens == list(first.outputs[0].token_ids) == hf_greedy(folder, PROMPT, 6)


def test_truncated_and_foreign_files_are_never_used(model_dir, hf_greedy, tmp_path):
    folder, other = model_dir("llama"), model_dir("qwen2")
    _serve(folder, tmp_path)
    (mine,) = {p.parent for p in _block_files(tmp_path).values()}
    _serve(other, tmp_path)  # the same prompt's keys, in the other model's folder
    (foreign,) = {p.parent for p in _block_files(tmp_path).values()} - {mine}
    keys = _keys()
    truncated = mine / (keys[3].hex() + kv_block_file.SUFFIX)
    truncated.write_bytes(truncated.read_bytes()[:-7])
    again = _serve(folder, tmp_path)
    assert again.num_cached_tokens == 12  # blocks 0-2: the truncated block 3 ends the hit
    assert list(again.outputs[0].token_ids) == hf_greedy(folder, PROMPT, 6)
    # another model's file under our first block's name: its header's identity differs
    head = keys[0].hex() + kv_block_file.SUFFIX
    (mine / head).write_bytes((foreign / head).read_bytes())
    again = _serve(folder, tmp_path)
    assert again.num_cached_tokens == 0
    assert list(again.outputs[0].token_ids) == hf_greedy(folder, PROMPT, 6)


def test_a_file_corrupted_after_the_scan_is_recomputed(model_dir, hf_greedy, tmp_path):
    folder = model_dir("llama")
    _serve(folder, tmp_path)
    llm = LLM(str(folder), kv_offload_dir=str(tmp_path), enable_prefix_caching=True, **ENGINE)
    try:
        path = _block_files(tmp_path)[_keys()[2]]  # scanned already: the index holds it
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # same length, wrong checksum
        path.write_bytes(bytes(data))
        out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
        assert llm.engine.core.scheduler.num_preemptions >= 1  # the failed load, recomputed
    finally:
        llm.engine.close()
    assert list(out.outputs[0].token_ids) == hf_greedy(folder, PROMPT, 6)
