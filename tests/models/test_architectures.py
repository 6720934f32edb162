"""More HF architectures through the engine (native or transformers fallback): greedy
outputs equal HF generate on tiny random models; unsupported ones fail clearly."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagestream import LLM, SamplingParams
from services.common.model_errors import ModelLoadError
from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**COMMON, intermediate_size=96),
    "phi3": lambda: transformers.Phi3Config(
        **COMMON, intermediate_size=96, num_key_value_heads=2, pad_token_id=0
    ),
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=16
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=16
    ),
    "falcon": lambda: transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4
    ),
}
PROMPT = [5, 17, 33, 99, 250, 12, 8, 41, 7, 7, 300]


def _save(config, folder):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_hf(tmp_path, name):
    model = _save(CONFIGS[name](), tmp_path)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    if 2 in ref:
        ref = ref[: ref.index(2) + 1]
    # A 4-token budget: the prompt runs in chunks over the cache, two requests share a batch.
    llm = LLM(str(tmp_path), kv_cache_memory="8MiB", max_num_batched_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=10)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [ref, ref]


# Loaded by transformers under any attention name, but Bloom runs its own attention and
# Mamba keeps a recurrent state: the load-time probe refuses both.
UNPAGEABLE = {
    "bloom": lambda: transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2
    ),
    "mamba": lambda: transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2
    ),
    "gpt_neo": lambda: transformers.GPTNeoConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
    ),
}


def test_attention_sinks_are_refused_by_name(tmp_path):
    """gpt-oss passes a learned sink logit per head (s_aux) that our kernels would drop."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    _save(config, tmp_path)
    with pytest.raises(ModelLoadError, match="attention sinks"):
        LLM(str(tmp_path), kv_cache_memory="8MiB")


@pytest.mark.parametrize("name", sorted(UNPAGEABLE))
def test_architecture_without_attention_interface_fails_clearly(tmp_path, name):
    _save(UNPAGEABLE[name](), tmp_path)
    with pytest.raises(ModelLoadError, match="not supported yet"):
        LLM(str(tmp_path), kv_cache_memory="8MiB")
