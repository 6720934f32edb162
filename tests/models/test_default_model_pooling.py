"""The default model (SmolLM2-135M-Instruct, its GGUF de-quantized) as a pooling runner:
embeddings equal HF AutoModel's on the same converted weights (float32, cosine > 0.9999),
for LAST and MEAN pooling, prompts chunked over several steps."""

import numpy as np
import pytest

from pagestream import LLM
from services.worker.models.gguf_weights import dequantized_folder
from tests.helpers.hf_pooling import cosine, hf_pooled, normalized

pytestmark = pytest.mark.slow

TEXTS = [
    "What is the capital of France?",
    "Paged attention keeps the key and value cache in fixed-size blocks, so sequences of "
    "any length share one pool of memory without fragmentation.",
    "def add(a, b):\n    return a + b",
]
ENGINE = {"kv_cache_memory": "64MiB", "max_num_batched_tokens": 16, "dtype": "float32"}


@pytest.fixture(scope="module")
def reference_folder():
    return dequantized_folder("smollm2-135m-instruct")


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_default_model_embeddings_equal_hf(reference_folder, pooling_type):
    llm = LLM(
        runner="pooling",
        quantization="none",
        pooler_config={"pooling_type": pooling_type},
        **ENGINE,
    )
    try:
        outputs = llm.embed(TEXTS, use_tqdm=False)
    finally:
        llm.engine.close()
    for output in outputs:
        ref = normalized(hf_pooled(reference_folder, output.prompt_token_ids, pooling_type))
        got = np.asarray(output.outputs.embedding)
        assert got.shape == (576,)
        assert cosine(got, ref) > 0.9999
