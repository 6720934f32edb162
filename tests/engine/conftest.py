"""Tiny random models saved as real HF folders *with* a tokenizer, and HF references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.worker.conftest import build_tiny_model

VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks.",
    "héllo wörld, ça va? naïve café 日本語 🙂",
    "def main():\n    return 42\n",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,
        special_tokens=["<unk>", "<s>", "</s>"],  # ids 0, 1, 2 = the models' bos/eos
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """name -> folder with weights, config and tokenizer (built once per session)."""
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
