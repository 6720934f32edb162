import pytest

from services.common.sampling_params import SamplingParams
from services.frontend.detokenizer import IncrementalDetokenizer
from tests.helpers.unicode_corpus import CORPUS


def _stream(tokenizer, prompt, ids, params, step=1):
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas = []
    for i in range(0, len(ids), step):
        update = detok.update(ids[i : i + step], finished=i + step >= len(ids))
        deltas.append(update.text_delta)
        if update.stop_string is not None:
            break
    return detok, deltas


@pytest.mark.parametrize("text", [*CORPUS, "unseen wörds ✨ and ünïcödé 🎉🎉"])
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_text_equals_full_decode(byte_tokenizer, text, step):
    prompt = byte_tokenizer.encode("Prompt: ")
    ids = byte_tokenizer.encode(text)
    detok, deltas = _stream(byte_tokenizer, prompt, ids, SamplingParams(), step)
    assert "".join(deltas) == byte_tokenizer.decode(ids) == detok.output_text
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_special_tokens_skipped_or_kept(byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    ids = [*byte_tokenizer.encode("the end"), eos]
    skipped, _ = _stream(byte_tokenizer, [], ids, SamplingParams())
    kept, _ = _stream(byte_tokenizer, [], ids, SamplingParams(skip_special_tokens=False))
    assert skipped.output_text == "the end"
    assert kept.output_text == "the end<eos>"


def test_stop_string_trims_and_reports(byte_tokenizer):
    ids = byte_tokenizer.encode("The end is near; the end is here.")
    detok, deltas = _stream(byte_tokenizer, [], ids, SamplingParams(stop=["near"]))
    assert detok.output_text == "The end is "
    assert detok.stop_string == "near"
    assert "".join(deltas) == "The end is "


def test_include_stop_str_in_output(byte_tokenizer):
    ids = byte_tokenizer.encode("The end is near; the end is here.")
    params = SamplingParams(stop=["; the"], include_stop_str_in_output=True)
    detok, _ = _stream(byte_tokenizer, [], ids, params)
    assert detok.output_text == "The end is near; the"


def test_text_that_may_become_a_stop_string_is_held_back(byte_tokenizer):
    params = SamplingParams(stop=["STOP!"])
    detok = IncrementalDetokenizer(byte_tokenizer, [], params)
    released = ""
    text = "Stop here. STOP"
    for token_id in byte_tokenizer.encode(text):
        released += detok.update([token_id], finished=False).text_delta
    assert released == "Stop here. "  # "STOP" could still become "STOP!"
    final = detok.update(byte_tokenizer.encode("!"), finished=False)
    assert final.stop_string == "STOP!" and final.text_delta == ""
    assert detok.output_text == "Stop here. "


def test_held_text_is_released_when_finished(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams(stop=["STOP!"]))
    assert detok.update(byte_tokenizer.encode("ok STO"), finished=False).text_delta == "ok "
    assert detok.update([], finished=True).text_delta == "STO"


def test_a_multibyte_stop_string_across_tokens(byte_tokenizer):
    ids = byte_tokenizer.encode("日本語のテキストです。")
    detok, deltas = _stream(byte_tokenizer, [], ids, SamplingParams(stop=["のテ"]))
    assert detok.stop_string == "のテ"
    assert "".join(deltas) == detok.output_text == "日本語"
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("include", [False, True])
def test_in_one_step_the_stop_completed_first_wins(byte_tokenizer, include):
    ids = byte_tokenizer.encode("The end is near; the end is here.")
    params = SamplingParams(stop=["end is near", "end is"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(byte_tokenizer, [], params)
    update = detok.update(ids, finished=False)
    # Each token's text is searched as it comes: "end is" is complete before "near" is.
    assert update.stop_string == "end is"
    assert update.text_delta == detok.output_text == ("The end is" if include else "The ")
    assert byte_tokenizer.decode(ids[: update.num_tokens_kept]) == "The end is"
