"""Many long stop strings cannot stall the frontend's event loop: each token's text is read
once against all of them (the cost of a step does not grow with the text generated, the
number of stops or their length), and a request's n sequences share one automaton."""

from __future__ import annotations

import random
import time
from collections import OrderedDict

import pytest

from services.common.sampling_params import SamplingParams
from services.frontend import stop_automaton as automata
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.stop_automaton import stop_automaton
from tests.helpers.tiny_tokenizer import CORPUS, build_tokenizer

NUM_STOPS, STOP_CHARS, NUM_TOKENS = 200, 1000, 2000
# Building the automaton and reading the tokens take well under a second here; a search of
# every stop over the text's tail on every token took over a minute.
BOUND_S = 5.0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _hostile_stops(text: str) -> list[str]:
    """Long stops over the text's own characters, so their prefixes keep matching its tail,
    each ending in a character it never has."""
    rng = random.Random(0)
    alphabet = sorted(set(text))
    return ["".join(rng.choices(alphabet, k=STOP_CHARS - 1)) + "\x00" for _ in range(NUM_STOPS)]


def test_a_step_costs_little_whatever_the_stops_and_the_text(tokenizer):
    ids = tokenizer.encode(" ".join(CORPUS * 60), add_special_tokens=False)[:NUM_TOKENS]
    stops = _hostile_stops(tokenizer.decode(ids))
    started = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=stops))
    text = "".join(detok.update([token], finished=False).text_delta for token in ids)
    text += detok.update([], finished=True).text_delta
    elapsed = time.perf_counter() - started
    assert detok.stop_string is None and text == tokenizer.decode(ids)
    assert elapsed < BOUND_S, f"{NUM_TOKENS} tokens with {NUM_STOPS} stops took {elapsed:.1f} s"


def test_the_sequences_of_a_request_share_one_automaton():
    stops = ["\x00" + "x" * 50, "y" * 50]
    assert stop_automaton(tuple(stops)) is stop_automaton(tuple(list(stops)))


@pytest.mark.parametrize("nodes, automata_kept", [(200, 64), (10**6, 3)])
def test_the_automata_kept_are_bounded_in_nodes_and_number(monkeypatch, nodes, automata_kept):
    monkeypatch.setattr(automata, "_cache", OrderedDict())
    monkeypatch.setattr(automata, "_CACHED_NODES", nodes)
    monkeypatch.setattr(automata, "_CACHED_AUTOMATA", automata_kept)
    first = stop_automaton(("first" * 20,))  # 101 nodes
    assert stop_automaton(("first" * 20,)) is first
    stop_automaton(("second" * 20,))  # 121 nodes: the two hold over 200
    third = stop_automaton(("third",))
    stop_automaton(("fourth",))  # a fourth automaton
    assert stop_automaton(("first" * 20,)) is not first  # the least recently used went
    assert stop_automaton(("third",)) is third
