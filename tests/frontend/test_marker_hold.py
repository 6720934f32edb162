"""held_marker_suffix against the plain definition: the longest suffix of the text that
is a proper prefix of the marker (markers with repeated characters included)."""

from hypothesis import given
from hypothesis import strategies as st

from services.frontend.marker_hold import held_marker_suffix


def _reference(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@given(st.text("abx<", max_size=12), st.text("ab<", min_size=1, max_size=6))
def test_matches_the_definition(text, marker):
    assert held_marker_suffix(text, marker) == _reference(text, marker)


def test_the_longest_candidate_wins():
    assert held_marker_suffix("xaa", "aab") == 2
    assert held_marker_suffix("thinking </thi", "</think>") == 5
    assert held_marker_suffix("done", "</think>") == 0
