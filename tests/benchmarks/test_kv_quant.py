"""benchmarks/kv_quant.py on a tiny GGUF file: each side runs in its own process, the
sides alternate, the decode is timed from its first token to its last, and the ratios put
the compared KV dtype over the baseline; q8_0 keeps about half bf16's bytes per token."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_quant
from tests.helpers.tiny_gguf_pair import tiny_gguf_pair


@pytest.fixture
def tiny_file(tmp_path, monkeypatch):
    return tiny_gguf_pair(tmp_path, monkeypatch)[0]


def _options(model: str, kv_dtypes: tuple[str, str]) -> kv_quant.KvQuantOptions:
    return kv_quant.KvQuantOptions(
        model=model,
        context=40,
        decode_tokens=4,
        rounds=2,
        kv_cache_memory="16MiB",
        kv_dtypes=kv_dtypes,
    )


def test_q8_0_against_bfloat16_on_a_tiny_file(tiny_file):
    result = kv_quant.run_kv_quant(_options(tiny_file, ("bfloat16", "q8_0")))
    bf16, q8 = result["sides"]["bfloat16"], result["sides"]["q8_0"]
    assert [r["kv_dtype"] for r in bf16["rounds"]] == ["bfloat16"] * 2
    assert len(q8["rounds"]) == 2 and all(r["decode_tok_s"] > 0 for r in q8["rounds"])
    assert bf16["kv_bytes_per_token"] == 2 * 2 * 32 * 2  # layers x (K, V) x head_dim x 2 bytes
    # 32 int8 values and a 2-byte scale per 32 (or a 4-byte scale): about half
    assert 0.5 < result["kv_bytes_ratio"] <= 0.6
    assert result["kv_bytes_ratio"] == pytest.approx(q8["kv_bytes_per_token"] / 256, abs=1e-3)
    assert result["decode_speedup"] == pytest.approx(
        q8["decode_tok_s"] / bf16["decode_tok_s"], rel=0.01
    )
    assert set(result["targets_met"]) == {"decode_speedup >= 1.1", "kv_bytes_ratio <= 0.55"}
    assert 0 <= result["greedy_common_tokens"] <= kv_quant.COMPARED_TOKENS


def test_the_sides_take_turns_going_first():
    assert kv_quant._order(("bfloat16", "q8_0"), 0) == ["bfloat16", "q8_0"]
    assert kv_quant._order(("bfloat16", "q8_0"), 1) == ["q8_0", "bfloat16"]


def test_the_context_is_seeded_byte_tokens():
    ids = kv_quant.context_ids(500, 300, seed=1)
    assert ids == kv_quant.context_ids(500, 300, seed=1) != kv_quant.context_ids(500, 300, 2)
    assert min(ids) >= kv_quant.FIRST_ID and max(ids) < kv_quant.FIRST_ID + 256
    assert max(kv_quant.context_ids(500, 100, seed=1)) < 100


def test_an_unknown_kv_dtype_is_named():
    with pytest.raises(ValueError, match="--kv-cache-dtype int3 not supported by this build"):
        kv_quant.check_kv_dtype("int3")


def test_llama_server_gets_the_kv_type_and_flash_attention():
    server = kv_quant.LlamaServer("llama-server", "m.gguf", "q8_0", context=16064, threads=2)
    command = server.command()
    for flag, value in (("-ctk", "q8_0"), ("-ctv", "q8_0"), ("-fa", "on"), ("-c", "16064")):
        assert command[command.index(flag) + 1] == value


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"rounds": 0}, "must be >= 1"),
        ({"context": 0}, "must be >= 1"),
        ({"decode_tokens": 1}, "decode_tokens must be >= 2"),
        ({"kv_dtypes": ("q8_0", "q8_0")}, "two different dtypes"),
    ],
)
def test_options_refuse_empty_runs(bad, message):
    with pytest.raises(ValueError, match=message):
        kv_quant.KvQuantOptions(**bad)


def test_the_command_line_is_recorded(monkeypatch, tmp_path):
    seen = {}

    def run(options):
        seen["o"] = options
        return {"decode_speedup": 1.2, "kv_bytes_ratio": 0.53, "targets_met": {}}

    monkeypatch.setattr(kv_quant, "run_kv_quant", run)
    out = tmp_path / "r.json"
    argv = ["--context", "64", "--kv-dtypes", "float32,q8_0", "--out", str(out)]
    assert kv_quant.main(argv) == 0
    assert seen["o"].context == 64 and seen["o"].kv_dtypes == ("float32", "q8_0")
    result = json.loads(out.read_text())
    assert result["command"] == "python -m benchmarks.kv_quant " + " ".join(argv)
    assert result["threads"] == 2 and result["machine"]["cpu"]
    assert set(result["load_average"]) == {"start", "end"}
