"""`pagestream bench reply_parsing --profile smoke`: the scripted model is built and served
twice (no parsers, parsers), every run streams the whole reply, the CPU per token, the
tracker's cost and the first events are recorded, the report gets its section; and the
pieces on their own (the script, the parse check, the summary, the profile's bounds).
No timing assertions: only that the figures are there and consistent."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.chat_tracker_timing import check_parse, replay, token_outputs
from benchmarks.reply_parsing import (
    REPLY_PARSING_PROFILES,
    VARIANTS,
    ReplyParsingOptions,
    served_summary,
)
from benchmarks.reports import REPLY_PARSING
from benchmarks.scripted_chat import ScriptedChat
from benchmarks.sections import BY_NAME
from tests.benchmarks.bench import bench, report

PROFILE = REPLY_PARSING_PROFILES["smoke"]
CHAT = ScriptedChat(PROFILE.thinking, PROFILE.answer)


@pytest.fixture(scope="module")
def reply_run(tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs-reply-parsing")
    return docs, bench(docs, "reply_parsing", "--profile", "smoke")


def test_the_section_runs_on_its_own_model(reply_run):
    _, results = reply_run
    assert set(results) == {"reply_parsing"}  # other sections and their meta are left alone
    part = results["reply_parsing"]["qwen3_hermes"]
    meta = part["meta"]
    assert meta["model"] == BY_NAME["reply_parsing"].model and "workload" not in meta
    assert meta["command"].startswith("pagestream bench reply_parsing --profile smoke")
    assert part["reply"]["tokens"] == len(CHAT.pieces)
    assert set(part["load_average"]) == {"start", "end"}


def test_every_served_run_streams_the_whole_reply(reply_run):
    part = reply_run[1]["reply_parsing"]["qwen3_hermes"]
    runs = part["runs"]
    assert len(runs) == PROFILE.rounds * len(PROFILE.concurrencies) * len(VARIANTS)
    for run in runs:
        assert run["failures"] == 0, run["failure_examples"]
        assert run["requests"] == run["concurrency"] * PROFILE.requests_per_client
        assert run["output_tokens"] == run["requests"] * (len(CHAT.pieces) + 1)  # + EOS
        assert run["frontend_us_per_token"] > 0 and run["engine_core_us_per_token"] > 0
    served = part["served"]
    assert set(served) == {str(c) for c in PROFILE.concurrencies}
    for row in served.values():
        assert row["frontend_cpu_ratio"] > 0
        assert len(row["frontend_cpu_ratio_per_round"]) == PROFILE.rounds
        assert row["target_met"] == (row["frontend_cpu_ratio"] <= 1.05)


def test_tracker_cost_and_first_events_are_recorded(reply_run):
    part = reply_run[1]["reply_parsing"]["qwen3_hermes"]
    tracker = part["tracker_update"]
    assert tracker["tokens_per_pass"] == len(CHAT.pieces)
    assert tracker["us_per_token"]["parsers"] > 0 and tracker["us_per_token"]["no_parsers"] > 0
    first = part["first_event"]
    assert "error" not in first, first.get("error")
    assert first["requests_per_api"] == PROFILE.first_event_requests
    for api in ("openai_chat", "anthropic_messages"):
        event, delta = first[api]["first_event_ms"], first[api]["first_delta_ms"]
        assert 0 < event["p50"] <= delta["p50"]
    assert first["first_event_ratio"] > 0


def test_the_report_gets_its_section(reply_run):
    docs, _ = reply_run
    text = report(docs)
    assert text.count(f"## {REPLY_PARSING.heading}") == 1
    assert "pagestream bench reply_parsing --profile smoke" in text
    assert "frontend cpu ratio" in text and "first event ratio" in text


def test_the_script_is_distinct_pieces_that_parse_back():
    pieces = CHAT.pieces
    assert len(set(pieces)) == len(pieces)
    assert pieces[0] == "<think>" and "</think>" in pieces and pieces[-1] == "</tool_call>"
    _, tracker = replay(CHAT, True, token_outputs(CHAT))
    check_parse(CHAT, tracker)  # raises on a wrong split


def test_the_parse_check_fails_on_a_wrong_split():
    _, unparsed = replay(CHAT, False, token_outputs(CHAT))  # all content, no call
    with pytest.raises(AssertionError, match="parsed wrongly"):
        check_parse(CHAT, unparsed)
    other = ScriptedChat(CHAT.thinking + 1, CHAT.answer)
    _, tracker = replay(other, True, token_outputs(other))
    with pytest.raises(AssertionError, match="parsed wrongly"):
        check_parse(CHAT, tracker)


def test_the_summary_pairs_each_round():
    def run(variant, round_index, us):
        return {
            "variant": variant,
            "concurrency": 1,
            "round": round_index,
            "frontend_us_per_token": us,
            "engine_core_us_per_token": 1000.0,
            "output_tokens_per_s": 500.0,
        }

    runs = [run("no_parsers", 0, 100.0), run("parsers", 0, 104.0)]
    runs += [run("parsers", 1, 130.0), run("no_parsers", 1, 100.0)]
    row = served_summary(runs, (1,))["1"]
    assert row["frontend_cpu_ratio_per_round"] == [1.04, 1.3]
    assert row["frontend_cpu_ratio"] == 1.17 and row["target_met"] is False
    assert row["no_parsers.frontend_us_per_token"] == 100.0


@pytest.mark.parametrize(
    "change",
    [{"rounds": 0}, {"requests_per_client": 0}, {"concurrencies": ()}, {"micro_passes": 0}],
)
def test_a_profile_without_work_is_refused(change):
    with pytest.raises(ValueError, match="at least 1"):
        ReplyParsingOptions(dataclasses.replace(PROFILE, **change))


def test_a_script_without_words_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        ScriptedChat(0, 3)
