"""Two tiny GGUF files of one shape (other seeds) with a head_dim of 32, q8_0 KV's block:
the stand-ins for the 1.5B-shaped files of benchmarks.model_switch, kv_offload and kv_quant."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.model_cache import isolated_model_cache
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_model

# 2 heads of 32 over the tiny Llama's hidden size of 64; one KV head
SHAPE = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300}


def tiny_gguf_pair(tmp_path: Path, monkeypatch) -> tuple[str, str]:
    """The files (Q8_0 matrices), converted under an isolated $PAGESTREAM_CACHE."""
    isolated_model_cache(tmp_path / "cache", monkeypatch)
    paths = []
    for seed in (3, 4):
        path = tmp_path / f"tiny-{seed}.gguf"
        write_tiny_gguf(path, build_tiny_model("llama_tied", seed=seed, **SHAPE), "Q8_0")
        paths.append(str(path))
    return paths[0], paths[1]
