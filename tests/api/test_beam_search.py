"""Beam search inside the engine equals HF generate(num_beams=k, do_sample=False)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagestream import LLM, BeamSearchParams

PROMPTS = [[5, 17, 33, 99, 250, 12, 8, 41], [300, 301, 302], [9] * 21, [44, 45, 46, 47, 48] * 3]


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()


def _hf_beams(model, prompt, width, max_tokens, length_penalty=1.0):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            num_return_sequences=width,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    sequences = [s[len(prompt) :].tolist() for s in out.sequences]
    return sequences, out.sequences_scores.tolist()


def _strip(tokens, eos=2, pad=0):
    """HF pads shorter beams; cut at the first EOS (kept) or trailing padding."""
    if eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    while tokens and tokens[-1] == pad:
        tokens = tokens[:-1]
    return tokens


@pytest.mark.parametrize(("width", "max_tokens"), [(2, 8), (4, 12)])
def test_beam_search_equals_hf(model_dir, hf, width, max_tokens):
    llm = LLM(str(model_dir("llama")), kv_cache_memory="8MiB", block_size=4)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        sequences, scores = _hf_beams(hf, prompt, width, max_tokens)
        ours = [o.token_ids for o in result.outputs]
        assert ours[0] == _strip(sequences[0])  # the best beam, token for token
        assert ours == [_strip(s) for s in sequences]
        for output, score in zip(result.outputs, scores, strict=True):
            normalised = output.cumulative_logprob / len(output.token_ids)
            assert normalised == pytest.approx(score, abs=1e-4)
    assert llm.engine.scheduler.kv.usage == 0.0
    assert not llm.engine.scheduler.groups.beam_groups


def test_beams_share_blocks(model_dir):
    llm = LLM(str(model_dir("llama")), kv_cache_memory="8MiB", block_size=4)
    engine = llm.engine
    kv = engine.scheduler.kv
    prompt = {"prompt_token_ids": list(range(3, 43))}  # 10 full blocks of prompt
    engine.add_request("beam", prompt, BeamSearchParams(4, 10).to_sampling_params())
    peak, shared_seen = 0, False
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        tables = [kv.req_to_blocks[r.request_id][0] for r in engine.scheduler.running]
        if len(tables) == 4:
            shared_seen |= all(t[0] is tables[0][0] for t in tables)
    assert shared_seen  # all four beams point at the same prompt blocks
    assert peak < 4 * (10 + 3)  # far below four separate 50-token sequences
    assert kv.usage == 0.0


@pytest.mark.parametrize("length_penalty", [1e300, -1e300, 800.0, -800.0])
def test_extreme_length_penalty_finishes(model_dir, length_penalty):
    """Penalties whose length ** penalty over- or underflows a float still end the search."""
    llm = LLM(str(model_dir("llama")), kv_cache_memory="8MiB", block_size=4)
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty)
    (result,) = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)
    assert len(result.outputs) == 2
    assert all(1 <= len(o.token_ids) <= 4 for o in result.outputs)
    assert llm.engine.scheduler.kv.usage == 0.0


def test_length_normalized_matches_power_and_saturates():
    from services.scheduler.beam_search import length_normalized

    assert length_normalized(-3.0, 4, 1.5) == -3.0 / 4**1.5
    assert length_normalized(-3.0, 4, 1e300) == 0.0
    assert length_normalized(-3.0, 4, -1e300) == float("-inf")
    assert length_normalized(0.0, 4, -1e300) == 0.0
