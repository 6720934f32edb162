import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? naïve café",
    "日本語のテキストです。 中文字符 🙂🚀 emoji",
    "def main():\n    return 42\n",
    "Stop here. STOP! The end is near; the end is here.",
]


@pytest.fixture(scope="session")
def byte_tokenizer():
    """A small byte-level BPE tokenizer trained here (no hub), with an EOS special token."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
