"""Speculative decoding as a client of the OpenAI server sees it: /metrics counts the
proposals, acceptances and accepted tokens per position (the engine's SchedulerStats),
model_info and /v1/models name the speculation, and a plain server reports none."""

from __future__ import annotations

from tests.helpers.openai_server import MODEL, running_server
from tests.helpers.spec_decode import copy_heavy_prompts, spec_config

ENGINE = '{engine="0"}'


async def _serve_and_count(folder, **engine_args):
    """Two copy-heavy greedy completions; /metrics once idle, /v1/models, the stats."""
    async with running_server(folder, **engine_args) as server:
        client = server.async_client()
        for prompt in copy_heavy_prompts(seed=21)[:2]:
            await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=14, temperature=0
            )
        samples = await server.wait_until_idle()
        models = await client.models.list()
        stats = server.engine.engine.scheduler.get_stats()
    return samples, models.data[0], stats


async def test_metrics_count_the_draft_models_proposals(model_dir):
    folder = model_dir("llama")
    samples, card, stats = await _serve_and_count(
        folder, speculative_config=spec_config("draft_model", folder, k=3)
    )
    drafts = samples[f"pagestream:spec_decode_num_drafts_total{ENGINE}"]
    proposed = samples[f"pagestream:spec_decode_num_draft_tokens_total{ENGINE}"]
    accepted = samples[f"pagestream:spec_decode_num_accepted_tokens_total{ENGINE}"]
    assert (drafts, proposed, accepted) == (
        stats.spec_decode_num_drafts,
        stats.spec_decode_num_draft_tokens,
        stats.spec_decode_num_accepted_tokens,
    )
    assert drafts > 0 and accepted == proposed  # the target as its own draft
    per_pos = [
        samples[
            f'pagestream:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}}'
        ]
        for i in range(3)
    ]
    assert tuple(per_pos) == stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    (info,) = [k for k in samples if k.startswith("pagestream:model_info")]
    assert 'speculative_decoding="draft_model k=3"' in info
    assert card.speculative_decoding == "draft_model k=3"
    # the completions counted every token they returned: 2 x 14
    assert samples["pagestream:generation_tokens_total"] == 28


async def test_a_plain_server_reports_no_speculation(model_dir):
    samples, card, _ = await _serve_and_count(model_dir("llama"))
    assert samples[f"pagestream:spec_decode_num_drafts_total{ENGINE}"] == 0
    assert samples[f"pagestream:spec_decode_num_accepted_tokens_total{ENGINE}"] == 0
    assert not any("position=" in k for k in samples)
    (info,) = [k for k in samples if k.startswith("pagestream:model_info")]
    assert 'speculative_decoding="none"' in info
    assert getattr(card, "speculative_decoding", None) is None
