"""The model's generation_config.json supplies defaults for unset sampling fields (as vLLM's
`--generation-config auto`); set fields win; `generation_config="vllm"` ignores the file."""

import json
import shutil

import pytest

from pagestream import LLM, SamplingParams
from services.common.proto.pagestream.v1 import generation_pb2
from services.frontend.generation_defaults import load_generation_defaults
from services.frontend.generation_pb import generate_call_from_pb
from services.frontend.model_files import ModelFiles
from services.frontend.tokenizer import TokenizerLoadError
from tests.helpers.openai_server import MODEL, running_server

PROMPT = {"prompt_token_ids": [5, 17, 33, 99, 250, 12, 8, 41, 5, 17, 33]}
GEN_CONFIG = {"repetition_penalty": 1.8, "temperature": 0.0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def folder(model_dir, tmp_path_factory):
    """The tiny llama with a generation_config.json that sets sampling defaults."""
    target = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(model_dir("llama"), target)
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps(config | GEN_CONFIG))
    return target


def test_load_reads_only_sampling_values_that_differ_from_transformers(tmp_path, folder):
    assert load_generation_defaults(folder) == {
        "repetition_penalty": 1.8,
        "temperature": 0.0,
        "max_tokens": 6,
    }
    assert load_generation_defaults(folder, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.8, "eos_token_id": 2}))
    assert load_generation_defaults(folder, str(tmp_path)) == {"top_p": 0.8}
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        load_generation_defaults(folder, str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7.0}))
    with pytest.raises(ValueError, match="top_p"):
        load_generation_defaults(folder, str(tmp_path))


def test_model_files_hold_the_folder_tokenizer_and_defaults_of_one_read(tmp_path, folder):
    files = ModelFiles.load(str(folder))
    assert files.folder == folder and files.tokenizer is not None
    assert files.default_sampling == load_generation_defaults(folder)
    assert ModelFiles.load(str(folder), "vllm").default_sampling == {}
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert ModelFiles.load(str(bare)).tokenizer is None  # token-id prompts only
    with pytest.raises(TokenizerLoadError):
        ModelFiles.load(str(bare), require_tokenizer=True)


def test_llm_generate_without_params_uses_the_model_defaults(folder):
    llm = LLM(str(folder), kv_cache_memory="8MiB")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0, 1.8, 6)
    (implicit,) = llm.generate(PROMPT, use_tqdm=False)
    explicit = SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=6)
    (expected,) = llm.generate(PROMPT, explicit, use_tqdm=False)
    assert implicit.outputs[0].token_ids == expected.outputs[0].token_ids
    plain = LLM(str(folder), kv_cache_memory="8MiB", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_grpc_unset_fields_take_the_defaults_and_set_fields_win(folder):
    llm = LLM(str(folder), kv_cache_memory="8MiB")
    defaults = llm.engine.default_sampling
    request = generation_pb2.GenerateRequest(text="hello")
    call = generate_call_from_pb(request, None, defaults)
    assert (call.sampling_params.repetition_penalty, call.sampling_params.max_tokens) == (1.8, 6)
    request.sampling_params.repetition_penalty = 1.0
    request.sampling_params.max_tokens = 3
    call = generate_call_from_pb(request, None, defaults)
    assert (call.sampling_params.repetition_penalty, call.sampling_params.max_tokens) == (1.0, 3)


async def test_openai_requests_take_the_defaults(folder):
    async with running_server(folder, api_key=None) as server:
        client = server.async_client()

        async def complete(**sampling):
            """Six tokens for PROMPT, ignore_eos, plus the given sampling fields."""
            extra = {"ignore_eos": True} | sampling.pop("extra", {})
            reply = await client.completions.create(
                model=MODEL,
                prompt=PROMPT["prompt_token_ids"],
                max_tokens=6,
                extra_body=extra,
                **sampling,
            )
            return reply.choices[0].text

        implicit = await complete()
        explicit = await complete(temperature=0, extra={"repetition_penalty": 1.8})
        assert implicit == explicit
        overridden = await complete(temperature=0, extra={"repetition_penalty": 1.0})
        plain = LLM(str(folder), kv_cache_memory="8MiB", generation_config="vllm")
        (greedy,) = plain.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )
        assert overridden == greedy.outputs[0].text
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"ignore_eos": True},
        )
        assert chat.usage.completion_tokens == 6  # max_new_tokens is the default budget
