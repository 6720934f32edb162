"""llama.cpp's SentencePiece Unigram vocabulary (`tokenizer.ggml.model = "t5"`: the XLM-RoBERTa
encoders' bge-m3, multilingual-e5, ...) as an HF tokenizer, written from the file alone
(what it holds: `unigram_tokenizer`).
"""

from __future__ import annotations

from services.common.model_errors import ModelLoadError

UNIGRAM_MODEL = "t5"  # llama.cpp's name for SentencePiece Unigram vocabularies
_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 2, 3, 4, 5, 6  # gguf.TokenType
_SPECIAL_IDS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "sep": "seperator_token_id",  # (gguf's spelling)
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
    "mask": "mask_token_id",
}


def unigram_tokenizer(meta: dict, max_length: int):
    """The file's Unigram vocabulary as a PreTrainedTokenizerFast.

    llama.cpp's converter stores the HF tokenizer's pieces as they are ("▁"-prefixed words), their
    log-probabilities in `tokenizer.ggml.scores`, token types (control, unknown, unused, byte),
    SentencePiece's normalizer (`precompiled_charsmap`, `add_space_prefix`,
    `remove_extra_whitespaces`) and the special ids. The tokenizer is what transformers'
    XLMRobertaTokenizer builds from such a vocabulary: models.Unigram over (piece, score), the
    Precompiled normalizer, whitespace splitting then Metaspace ("▁", prepended), <s> A </s> and
    <s> A </s> </s> B </s> (type ids 0), control tokens special. Saved as a plain tokenizer.json
    (PreTrainedTokenizerFast), so every reader takes it as written: the file's own unknown id,
    which XLMRobertaTokenizer would fix at 3.
    """
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    kinds = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    ids = _special_ids(meta, kinds)
    mask = ids.get("mask")
    if mask is not None and kinds[mask] == _UNUSED:  # the converter's "[PAD{i}]" filler
        tokens[mask], kinds[mask] = "<mask>", _CONTROL
    vocab = [(piece, float(score)) for piece, score in zip(tokens, scores, strict=True)]
    model = Tokenizer(models.Unigram(vocab, unk_id=ids.get("unk"), byte_fallback=_BYTE in kinds))
    _sentencepiece_pipeline(
        model, meta, tokens[ids["bos"]], ids["bos"], tokens[ids["sep"]], ids["sep"]
    )
    specials = {i for i, kind in enumerate(kinds) if kind in (_UNKNOWN, _CONTROL)}
    model.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False, lstrip=i == mask)
            for i in sorted(specials | set(ids.values()))
        ]
    )
    user = [i for i, kind in enumerate(kinds) if kind == _USER_DEFINED]
    model.add_tokens([AddedToken(tokens[i], normalized=False) for i in user])
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        cls_token=tokens[ids["bos"]],
        model_max_length=max_length,
        model_input_names=["input_ids", "attention_mask"],
        **{f"{name}_token": tokens[i] for name, i in ids.items()},
    )


def _special_ids(meta: dict, kinds: list[int]) -> dict[str, int]:
    """bos, eos, sep (eos when the file has none), unk (the unknown-type token when the
    file names none), pad and mask ids, where the file has them."""
    ids = {
        name: int(meta[f"tokenizer.ggml.{key}"])
        for name, key in _SPECIAL_IDS.items()
        if f"tokenizer.ggml.{key}" in meta
    }
    if "unk" not in ids and _UNKNOWN in kinds:
        ids["unk"] = kinds.index(_UNKNOWN)
    if "sep" not in ids and "eos" in ids:
        ids["sep"] = ids["eos"]
    if "bos" not in ids or "sep" not in ids:
        raise ModelLoadError("the encoder GGUF's Unigram vocabulary has no bos / eos token ids")
    return ids


def _sentencepiece_pipeline(model, meta: dict, cls: str, cls_id: int, sep: str, sep_id: int):
    """SentencePiece's normalizer (the file's charsmap), whitespace splitting (as
    remove_extra_whitespaces says), "▁" for spaces (prepended as add_space_prefix says), and
    XLM-R's <s> A </s> / <s> A </s> </s> B </s>."""
    from tokenizers import decoders, normalizers, pre_tokenizers, processors

    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        model.normalizer = normalizers.Precompiled(bytes(charsmap))
    prepend = "always" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", True):
        metaspace = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    model.pre_tokenizer = metaspace
    model.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    model.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} {sep} $B {sep}",
        special_tokens=[(cls, cls_id), (sep, sep_id)],
    )
