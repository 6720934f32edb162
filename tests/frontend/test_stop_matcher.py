"""StopMatcher finds the stop string and holds back the text a plain search over the whole
text would: the occurrence starting first among those ending in the newest piece (the stop
listed first on a tie), and the longest suffix that is a proper prefix of a stop."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.stop_automaton import StopAutomaton
from services.frontend.stop_matcher import StopMatch, StopMatcher


def _reference_match(text: str, start: int, stops: list[str]) -> StopMatch | None:
    """The search the matcher replaces: every stop looked for in the text that may overlap
    the piece added at `start`."""
    best: StopMatch | None = None
    for stop in stops:
        index = text.find(stop, max(0, start - len(stop) + 1))
        if index != -1 and (best is None or index < best.start):
            best = StopMatch(index, stop)
    return best


def _reference_held(text: str, stops: list[str]) -> int:
    return max(
        (size for stop in stops for size in range(1, len(stop)) if text.endswith(stop[:size])),
        default=0,
    )


def _pieces(text: str, sizes: list[int]) -> list[str]:
    pieces, start = [], 0
    for size in sizes:
        if start >= len(text):
            break
        pieces.append(text[start : start + size])
        start += size
    return [*pieces, text[start:]] if start < len(text) else pieces


_ALPHABET = "abc"
_stops = st.lists(st.text(_ALPHABET, min_size=1, max_size=6), min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(
    stops=_stops,
    text=st.text(_ALPHABET, max_size=40),
    sizes=st.lists(st.integers(1, 8), max_size=40),
)
def test_the_matcher_agrees_with_a_search_of_the_whole_text(stops, text, sizes):
    matcher, fed = StopMatcher(stops), ""
    for piece in _pieces(text, sizes):
        start, fed = len(fed), fed + piece
        expected = _reference_match(fed, start, stops)
        assert matcher.feed(piece) == expected, (fed, piece)
        if expected is not None:
            return
        assert matcher.held == _reference_held(fed, stops), fed


def test_a_stop_that_starts_first_wins_over_one_that_ends_first():
    assert StopMatcher(["bc", "abcd"]).feed("xabcdx") == StopMatch(1, "abcd")


def test_on_the_same_start_the_stop_listed_first_wins():
    assert StopMatcher(["abcd", "ab"]).feed("abcd") == StopMatch(0, "abcd")
    assert StopMatcher(["ab", "abcd"]).feed("abcd") == StopMatch(0, "ab")


def test_a_stop_split_over_pieces_is_found_where_it_ends():
    matcher = StopMatcher(["héllo wörld"])
    assert matcher.feed("say hé") is None and matcher.held == 2
    assert matcher.feed("llo wö") is None and matcher.held == 8
    assert matcher.feed("rld!") == StopMatch(4, "héllo wörld")


def test_held_text_is_released_once_it_cannot_begin_a_stop():
    matcher = StopMatcher(["STOP!", "abab"])
    assert matcher.feed("a STO") is None and matcher.held == 3  # "STO" of "STOP!"
    assert matcher.feed("P.") is None and matcher.held == 0
    assert matcher.feed("aba") is None and matcher.held == 3
    assert matcher.feed("a") is None and matcher.held == 1  # only the last "a" remains


def test_duplicate_and_nested_stops_share_the_trie():
    automaton = StopAutomaton(("ab", "abc", "ab", "b"))
    state = automaton.step(automaton.step(0, "a"), "b")
    assert automaton.stops[automaton.match(state)] == "ab"
    assert automaton.match(automaton.step(0, "b")) == 3
