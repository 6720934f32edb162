"""A tiny llama whose greedy reply is a text the test chooses, saved as a real HF folder.

The reply is given as pieces; each piece becomes one added token of the tiny tokenizer,
so a streamed reply arrives piece by piece (chunk boundaries where the test puts them,
e.g. inside a marker). The model is a bigram table: every layer's output projections are
zero, so the last hidden state is the current token's one-hot embedding, and lm_head maps
each piece to the next one (the last to EOS). The prompt's last token picks the script:
a trigger token starts its script, any other token the default one. So parsers are
checked against an exact, known reply through the whole server.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.tiny_tokenizer import build_tokenizer

EOS_ID = 2
LOGIT = 10.0  # the scripted token's logit after the final RMSNorm scales it by sqrt(d)


def build_scripted_model(
    folder: Path,
    scripts: dict[str | None, list[str]],
    chat_template: str | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """`scripts`: trigger token text (None: any other last prompt token) -> reply pieces.
    `extra_tokens`: more single tokens for the template (`<|im_start|>`, "\\n\\n")."""
    tokenizer = build_tokenizer()
    pieces = [p for script in scripts.values() for p in script]
    if len(set(pieces)) != len(pieces):
        raise ValueError("every piece of every script must be a distinct string")
    new = list(dict.fromkeys([*extra_tokens, *pieces]))
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in new])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    table = _bigram_table(tokenizer, scripts)
    _bigram_model(len(tokenizer), table).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _single_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is not one token: {ids}")
    return ids[0]


def _bigram_table(tokenizer, scripts: dict[str | None, list[str]]) -> dict[int, int]:
    """source token id -> the token greedy decoding picks after it."""
    vocab = len(tokenizer)
    table: dict[int, int] = {}
    default = scripts.get(None)
    if default:
        first = _single_id(tokenizer, default[0])
        table.update(dict.fromkeys(range(vocab), first))
    for trigger, script in scripts.items():
        ids = [_single_id(tokenizer, p) for p in script]
        if trigger is not None:
            table[_single_id(tokenizer, trigger)] = ids[0]
        table.update(zip(ids, [*ids[1:], EOS_ID], strict=True))
    return table


def _bigram_model(vocab: int, table: dict[int, int]) -> LlamaForCausalLM:
    hidden = 64 * math.ceil(vocab / 64)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight  # [vocab, hidden]: one-hot rows
        embed[torch.arange(vocab), torch.arange(vocab)] = 1.0
        head = model.lm_head.weight  # [vocab, hidden]
        for source, target in table.items():
            head[target, source] = LOGIT
    return model
