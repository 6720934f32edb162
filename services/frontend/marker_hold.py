"""held_marker_suffix: how much of a streamed text to hold back because it could still
become a marker (`</think>`, `<tool_call>`): the reasoning and tool-call parsers' one rule."""

from __future__ import annotations


def held_marker_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`. Runs on
    every streamed token, so only suffixes that begin with the marker's first character
    are tried (usually none), earliest (longest) first."""
    index = text.find(marker[0], max(len(text) - len(marker) + 1, 0))
    while index >= 0:
        if marker.startswith(text[index:]):
            return len(text) - index
        index = text.find(marker[0], index + 1)
    return 0
