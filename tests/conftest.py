"""Hypothesis profiles: `ci` replays the same examples on every run (HYPOTHESIS_PROFILE=ci, set
by .ci/run) so a green main stays green; the default explores new random examples each run.
Also the tiny random models with a tokenizer (`model_dir`) and their HF greedy references
(`hf_greedy`), shared by every folder that runs the whole engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# dtype "auto" is bfloat16 on CPUs with native bf16 (services/worker/model_loader.py); the
# tests compare with HF transformers in float32, so here "auto" means float32 (inherited by
# every role process they start). Tests of bf16 ask for dtype="bfloat16" themselves.
os.environ.setdefault("PAGESTREAM_CPU_DTYPE", "float32")

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """name -> folder with weights, config and tokenizer (built once per session)."""
    # imported here: a run of the folders that need no model stays free of torch
    from tests.helpers.tiny_models import build_tiny_model
    from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

    folders: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in folders:
            folder = tmp_path_factory.mktemp(f"engine-{name}")
            model = build_tiny_model(name, vocab_size=VOCAB)
            model.save_pretrained(folder)
            build_tokenizer().save_pretrained(folder)
            folders[name] = folder
        return folders[name]

    return get


@pytest.fixture(scope="session")
def hf_greedy():
    """(folder, prompt_ids, max_new_tokens) -> HF generate's greedy new token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict[Path, torch.nn.Module] = {}

    def run(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        model = cache[folder]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                pad_token_id=0,
            )
        return out[0, len(prompt_ids) :].tolist()

    return run


@pytest.fixture
async def engine(model_dir, request):
    """An in-process AsyncEngine over the tiny llama, one per test (tests abort, cut and
    patch it). A module passes other engine arguments as ENGINE_ARGS (a dict)."""
    from pagestream import AsyncEngine

    args = getattr(request.module, "ENGINE_ARGS", {"kv_cache_memory": "8MiB"})
    engine = AsyncEngine.from_args(str(model_dir("llama")), engine_core_process=False, **args)
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
def llm(model_dir, request):
    """The offline LLM, one per module: the tiny llama with LLM_ARGS (a dict, default an
    8 MiB KV cache); LLM_MODEL = None in a module means the default model instead."""
    from pagestream import LLM

    model = getattr(request.module, "LLM_MODEL", "llama")
    args = getattr(request.module, "LLM_ARGS", {"kv_cache_memory": "8MiB"})
    return LLM(str(model_dir(model)), **args) if model else LLM(**args)
