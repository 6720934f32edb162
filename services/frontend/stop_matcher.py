"""StopMatcher: one sequence's search for its stop strings, fed its text piece by piece.

Each piece is read once, a character at a time, through the stops' automaton
(stop_automaton.py), so a piece's cost depends neither on the text before it nor on the
stops. Within one piece, of the occurrences ending in it, the one that starts first wins
(at the same start, the stop listed first).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.frontend.stop_automaton import ROOT, stop_automaton


@dataclass(frozen=True)
class StopMatch:
    start: int  # offset of the stop string in the whole text fed
    stop: str

    @property
    def end(self) -> int:
        return self.start + len(self.stop)


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._automaton = stop_automaton(tuple(stops))
        self._state = ROOT
        self._length = 0  # characters fed so far

    @property
    def held(self) -> int:
        """How many trailing characters could still begin a stop string: the longest suffix
        of the text that is a proper prefix of a stop (a whole one would have matched)."""
        return self._automaton.depth(self._state)

    def feed(self, text: str) -> StopMatch | None:
        """Read `text`, which follows everything fed before; the stop string it completes.
        Once a stop string is found the search is over: nothing more is fed."""
        automaton, state = self._automaton, self._state
        best: tuple[int, int] | None = None  # (start, index in the stop list)
        for position, char in enumerate(text, self._length):
            state = automaton.step(state, char)
            if best is not None and position - automaton.depth(state) >= best[0]:
                break  # every later occurrence starts after the best one
            index = automaton.match(state)
            if index >= 0:
                # The longest stop ending here starts first among those that end here.
                candidate = (position + 1 - len(automaton.stops[index]), index)
                best = candidate if best is None else min(best, candidate)
        self._state, self._length = state, self._length + len(text)
        if best is None:
            return None
        return StopMatch(best[0], automaton.stops[best[1]])
