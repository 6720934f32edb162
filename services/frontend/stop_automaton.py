"""StopAutomaton: an Aho-Corasick automaton over a request's stop strings.

A state is a node of the stop strings' trie: the longest suffix of the text read so far
that is a prefix of some stop. Reading a character follows the trie edge or the failure
links: O(1) amortized per character whatever the text before and however many stops; a
match is seen on the character that completes it. Built in O(total stop length) and
immutable, so the sequences (and requests) with the same stops share one.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator

ROOT = 0
_NONE = -1
# The automata kept for reuse hold at most this many trie nodes together (about 20 bytes
# each), and are at most this many; the one just asked for is kept even when larger.
_CACHED_NODES = 1 << 20
_CACHED_AUTOMATA = 64


class StopAutomaton:
    """The trie lives in flat arrays rather than a dict per node, since the stops of one request
    can add up to many characters: inserting a stop creates its new nodes consecutively, so a
    node's child along the stop that created it is the next node id (a chain); only the edge
    where a stop leaves the existing trie, at most one per stop, is kept in a dict.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._owner = array("i", [_NONE])  # the stop whose insertion created the node
        self._depth = array("i", [0])  # the length of the node's string
        self._parent = array("i", [ROOT])
        self._branch: dict[tuple[int, str], int] = {}  # the edges that leave a chain
        self._ends: dict[int, int] = {}  # node -> the first stop (in list order) spelling it
        self._chains: list[tuple[int, int, int]] = []  # (first depth, first node, last depth)
        for index, stop in enumerate(stops):
            self._insert(index, stop)
        self.size = len(self._owner)  # trie nodes, what its memory is proportional to
        self._fail = array("i", [ROOT]) * self.size
        self._match = array("i", [_NONE]) * self.size  # the longest stop that is a suffix
        self._link()

    def depth(self, state: int) -> int:
        return self._depth[state]

    def match(self, state: int) -> int:
        """The index of the longest stop string the text read so far ends with, or -1."""
        return self._match[state]

    def step(self, state: int, char: str) -> int:
        """The state after reading `char` in `state`."""
        while (child := self._child(state, char)) == _NONE:
            if state == ROOT:
                return ROOT
            state = self._fail[state]
        return child

    def _child(self, node: int, char: str) -> int:
        owner = self._owner[node]
        chained = node + 1
        if (
            chained < len(self._owner)
            and self._owner[chained] == owner  # never for the root: no other node has owner -1
            and self.stops[owner][self._depth[node]] == char
        ):
            return chained
        return self._branch.get((node, char), _NONE)

    def _insert(self, index: int, stop: str) -> None:
        node, depth = ROOT, 0
        while depth < len(stop) and (child := self._child(node, stop[depth])) != _NONE:
            node, depth = child, depth + 1
        if depth < len(stop):
            # The new nodes depth + 1 .. len(stop) are consecutive ids owned by `index`, each
            # the chained child of the one before; the first hangs from `node` by a branch.
            first = len(self._owner)
            self._branch[(node, stop[depth])] = first
            self._owner.extend([index] * (len(stop) - depth))
            self._depth.extend(range(depth + 1, len(stop) + 1))
            self._parent.append(node)
            self._parent.extend(range(first, first + len(stop) - depth - 1))
            node = first + len(stop) - depth - 1
            self._chains.append((depth + 1, first, len(stop)))
        self._ends.setdefault(node, index)

    def _link(self) -> None:
        """Failure links and longest matches, shallower nodes first: a node's failure link
        is a shallower node, and so is every node its computation reads."""
        for node in self._by_depth():
            parent = self._parent[node]
            if parent != ROOT:
                char = self.stops[self._owner[node]][self._depth[node] - 1]
                self._fail[node] = self.step(self._fail[parent], char)
            self._match[node] = self._ends.get(node, self._match[self._fail[node]])

    def _by_depth(self) -> Iterator[int]:
        """Every node but the root, shallower first, from the chains (whose nodes have
        consecutive depths) rather than a sort of every node."""
        pending = sorted(self._chains, reverse=True)
        active: list[tuple[int, int, int]] = []
        for depth in range(1, max(map(len, self.stops), default=0) + 1):
            while pending and pending[-1][0] == depth:
                active.append(pending.pop())
            active = [chain for chain in active if chain[2] >= depth]
            for first_depth, first_node, _ in active:
                yield first_node + depth - first_depth


_cache: OrderedDict[tuple[str, ...], StopAutomaton] = OrderedDict()  # least recent first
_cache_lock = threading.Lock()  # stop_automaton may be called from any thread


def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton for `stops`, shared by the sequences (and requests) with these stops:
    the last few built are kept (a bounded number of nodes in all)."""
    with _cache_lock:
        automaton = _cache.pop(stops, None)
        if automaton is None:
            automaton = StopAutomaton(stops)
        _cache[stops] = automaton
        total = sum(kept.size for kept in _cache.values())
        while len(_cache) > 1 and (total > _CACHED_NODES or len(_cache) > _CACHED_AUTOMATA):
            total -= _cache.popitem(last=False)[1].size
        return automaton
