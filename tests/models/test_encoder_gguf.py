"""Encoder GGUF files (llama.cpp's `bert` and `nomic-bert`) embed as the sentence-transformers
folders they were made from: the files are written here as llama.cpp's converter writes them
(its tensor names, hyperparameter keys, its "phantom space" WordPiece vocabulary and
special token ids: checked once against convert_hf_to_gguf.py's own output for BERT), with
float32 tensors (equal within 1e-4) or Q8_0 matrices (cosine > 0.999)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from pagestream import LLM
from tests.helpers.encoder_folders import TEXTS, st_embeddings, st_folder
from tests.helpers.encoder_gguf import write_encoder_gguf
from tests.helpers.hf_pooling import cosine


@pytest.mark.parametrize("arch", ["bert", "nomic_bert"])
@pytest.mark.parametrize("quantized", [False, True])
def test_an_encoder_gguf_embeds_as_its_folder(tmp_path, arch, quantized):
    folder = st_folder(tmp_path, arch, "mean", True)
    expected = st_embeddings(folder, TEXTS)
    gguf_arch = "bert" if arch == "bert" else "nomic-bert"
    path = write_encoder_gguf(folder, gguf_arch, tmp_path / f"{arch}.gguf", quantized)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    try:
        got = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        ids = [llm.engine.tokenizer.encode(t) for t in TEXTS]
    finally:
        llm.engine.close()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert ids == [tokenizer.encode(t) for t in TEXTS]  # the file's vocabulary, read back
    for g, e in zip(got, expected, strict=True):
        if quantized:
            assert cosine(g, e) > 0.999
        else:
            assert cosine(g, e) > 0.9999
            np.testing.assert_allclose(g, e, atol=1e-4)
