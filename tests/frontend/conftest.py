import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.helpers.unicode_corpus import CORPUS


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
