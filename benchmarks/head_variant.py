"""A random model with the sizes of a given one but head counts a tensor-parallel size
divides, for the layouts the real model refuses (SmolLM2-135M's 9 query / 3 KV heads take
tp = 3; its variant for tp = 2 has 8 query heads of 72 and 2 KV heads). The rest (hidden
size, layers, MLP, vocabulary, tokenizer) stays, so a step does the same matmuls.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def divisible_heads(
    hidden_size: int, num_heads: int, num_kv_heads: int, tp: int
) -> tuple[int, int] | None:
    """The most query heads <= num_heads that tp divides (an even head_dim dividing
    hidden_size), and the most KV heads <= num_kv_heads that divide them and that tp
    divides or is divided by; None when there is no such split."""
    for heads in range(num_heads, 0, -1):
        head_dim, rest = divmod(hidden_size, heads)
        if heads % tp or rest or head_dim % 2:
            continue
        for kv in range(min(num_kv_heads, heads), 0, -1):
            if heads % kv == 0 and (kv % tp == 0 or tp % kv == 0):
                return heads, kv
    return None


def build_head_variant(folder: Path, tp: int, out: Path, seed: int = 0) -> dict | None:
    """Save the variant for ``tp`` of the model in ``folder`` to ``out`` (random weights, the
    original's tokenizer); its description, or None if no split exists."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    heads = divisible_heads(config.hidden_size, config.num_attention_heads, kv_heads, tp)
    if heads is None:
        return None
    config.num_attention_heads, config.num_key_value_heads = heads
    config.head_dim = config.hidden_size // heads[0]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    description = {"num_attention_heads": heads[0], "num_key_value_heads": heads[1]}
    description |= {"head_dim": config.head_dim, "weights": "random"}
    (out / "head_variant.json").write_text(json.dumps(description), encoding="utf-8")
    logger.info("head variant for tp=%d at %s: %s", tp, out, description)
    return description
