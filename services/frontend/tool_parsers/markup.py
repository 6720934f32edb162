"""What the hand-written call scanners (xml_call_stream.py, pythonic_call_stream.py,
mistral.py, json_list_call_stream.py) share: the bound on a name and the whitespace rule."""

from __future__ import annotations

# A function, parameter or keyword name longer than this is not a name: the text around it
# is malformed markup (content before a call, dropped after one), and the scanners never
# wait on more than this many characters for a name to end.
MAX_NAME_CHARS = 256


def skip_space(text: str, index: int) -> int:
    """The first index at or after `index` that is not whitespace (len(text) if none)."""
    while index < len(text) and text[index].isspace():
        index += 1
    return index
