"""benchmarks/kv_offload.py on a tiny GGUF file: the restarted server finds the prompt's
blocks in the directory (cached tokens in usage, the same reply), and with a host tier only
a prompt pushed out of the device cache comes back from host memory."""

from __future__ import annotations

import pytest

from benchmarks import kv_offload
from tests.helpers.tiny_gguf_pair import tiny_gguf_pair

PROMPT, BLOCK = 40, 16  # two full blocks and a partial one


def test_both_parts_on_a_tiny_file(tmp_path, monkeypatch):
    model = tiny_gguf_pair(tmp_path, monkeypatch)[0]
    options = kv_offload.OffloadOptions(
        model=model, prompt_tokens=PROMPT, max_tokens=4, engine={"kv_cache_memory": "16MiB"}
    )
    result = kv_offload.run_kv_offload(options)
    restart = result["restart"]
    assert restart["cold"]["cached_tokens"] == 0
    assert restart["restarted"]["cached_tokens"] == PROMPT // BLOCK * BLOCK
    assert restart["outputs_equal"] and restart["restarted"]["completion_tokens"] == 4
    assert restart["offload_dir_after_first"]["files"] >= PROMPT // BLOCK
    assert restart["ttft_speedup"] == pytest.approx(
        restart["cold"]["ttft_s"] / restart["restarted"]["ttft_s"], rel=0.01
    )
    host = result["host"]
    assert host["device_blocks"] == -(-(PROMPT + 4) // BLOCK) + kv_offload.SPARE_BLOCKS
    first, other, again = (host["runs"][name] for name in ("first", "other", "again"))
    assert first["cached_tokens"] == other["cached_tokens"] == 0
    assert again["cached_tokens"] == PROMPT // BLOCK * BLOCK
    assert again["kv_offload_hits"] > 0  # pushed out of the device cache, read back
    assert host["common_tokens"] >= 1  # the first token follows the same prefill


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt_tokens": 0}, "must be >= 1"),
        ({"parts": ("disk",)}, "parts must be among"),
        ({"parts": ()}, "parts must be among"),
    ],
)
def test_options_refuse_empty_or_unknown_runs(bad, message):
    with pytest.raises(ValueError, match=message):
        kv_offload.OffloadOptions(**bad)


def test_the_served_flags_name_the_directory_and_its_bound(tmp_path):
    options = kv_offload.OffloadOptions(prompt_tokens=100, max_tokens=8, offload_bytes="1GiB")
    flags = kv_offload.served_flags(options, tmp_path)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs["--kv-offload-dir"] == str(tmp_path)
    assert pairs["--kv-offload-bytes"] == "1GiB" and pairs["--max-model-len"] == "108"
