"""BlankPrefix: whether a streamed reply has shown anything but whitespace yet (a reply of
only calls and whitespace has content null, so whitespace before a call is held back)."""

from __future__ import annotations


class BlankPrefix:
    """Asked on every streamed token with a growing text; each character is read once
    (copying the whole prefix per token would make a long reply quadratic)."""

    def __init__(self) -> None:
        self.checked = 0  # text[:checked] was read
        self.seen = False  # a non-whitespace character was among it

    def has_text(self, text: str, end: int) -> bool:
        """Whether text[:end] holds a non-whitespace character (`text` only grows)."""
        if not self.seen and end > self.checked:
            self.seen = not text[self.checked : end].isspace()
            self.checked = end
        return self.seen
