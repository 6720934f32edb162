"""Every refused combination of engine arguments, refused when the arguments are parsed
(EngineArgs: nothing loads) or right after the workers describe their model, with a
message naming the flags; and what goes together is not refused."""

from __future__ import annotations

import dataclasses

import pytest

from pagestream.engine_args import EngineArgs
from services.common.compatibility import check_with_model
from services.common.lora_config import LoRAConfig
from services.common.model_capabilities import ModelCapabilities
from services.common.pooler_config import PoolerConfig
from services.common.speculative_config import SpeculativeConfig
from services.common.worker_info import ModelInfo

DRAFT = '{"method": "draft_model", "model": "draft", "num_speculative_tokens": 2}'
NGRAM = '{"method": "ngram", "num_speculative_tokens": 2}'


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (dict(convert="embed", runner="generate"), "--convert embed"),
        (dict(runner="pooling", speculative_config=NGRAM), "--speculative-config"),
        (dict(convert="embed", speculative_config=NGRAM), "--speculative-config"),
        (dict(runner="pooling", enable_lora=True), "--enable-lora"),
        (dict(speculative_config=DRAFT, tensor_parallel_size=2), "draft_model"),
        (dict(speculative_config=DRAFT, pipeline_parallel_size=2), "draft_model"),
    ],
)
def test_refused_when_the_arguments_are_parsed(arguments, words):
    with pytest.raises(ValueError, match=words):
        EngineArgs(model="no-such-model", **arguments)  # the model is never read


@pytest.mark.parametrize(
    "arguments",
    [
        dict(runner="pooling"),
        dict(convert="embed", runner="pooling"),
        dict(speculative_config=NGRAM, tensor_parallel_size=2),
        dict(speculative_config=DRAFT),
        dict(enable_lora=True, speculative_config=NGRAM),
    ],
)
def test_combinations_that_go_together(arguments):
    EngineArgs(model="no-such-model", **arguments)


LAST = PoolerConfig(pooling_type="LAST")
MODEL = ModelInfo("m", "LlamaModel", "float32", "cpu", 2, 2, 8, 64, (2,), 64)


@pytest.mark.parametrize(
    ("described", "words"),
    [
        (ModelCapabilities(pooler=LAST, speculative=SpeculativeConfig("ngram", 4)), "speculative"),
        (ModelCapabilities(pooler=LAST, lora=LoRAConfig()), "--enable-lora"),
    ],
)
def test_refused_once_the_workers_describe_a_pooling_model(described, words):
    """runner auto picked pooling for the model (a base checkpoint): what it runs beside
    is refused before any cache is laid out."""
    with pytest.raises(ValueError, match=words):
        check_with_model(EngineArgs(model="m"), dataclasses.replace(MODEL, capabilities=described))
    check_with_model(EngineArgs(model="m"), MODEL)  # a generating model with neither


def test_an_embedding_folder_with_speculation_is_refused_after_describe(tmp_path):
    """End to end: runner auto picks pooling for a sentence-transformers folder; the
    speculation asked beside it is refused by name, no engine is left running."""
    from pagestream import LLM
    from tests.helpers.encoder_folders import st_folder

    folder = st_folder(tmp_path, "bert", "mean", True)
    with pytest.raises(ValueError, match="--runner auto chose it"):
        LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", speculative_config=NGRAM)
