"""Router policies and the prefix index they read, on stand-in replicas."""

from dataclasses import dataclass, field

import pytest

from services.common.block_hash import hash_request_tokens
from services.common.kv_events import KvEventBatch
from services.frontend.prefix_index import PREDICTION_TTL_S, PrefixIndex
from services.frontend.router import Router, RouterConfig

BLOCK = 4


def _hashes(tokens, salt=None):
    return hash_request_tokens(tokens, BLOCK, cache_salt=salt)


@dataclass
class FakeReplica:
    name: str
    load: int = 0
    index: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def cached_blocks(self):
        return len(self.index)

    def matched_blocks(self, hashes):
        return self.index.match(hashes)


SYSTEM = list(range(100, 132))  # 8 blocks shared by a "conversation"


def test_cache_aware_sends_a_shared_prefix_to_the_replica_holding_it():
    a, b = FakeReplica("0"), FakeReplica("1")
    b.index.apply(KvEventBatch(reset=True, stored=_hashes(SYSTEM)))
    router = Router()
    prompt = _hashes([*SYSTEM, 7, 8, 9, 10])
    assert router.choose([a, b], prompt) == (b, "cache_hit")
    b.load = 5  # some load, but within balance: the cache still wins
    assert router.choose([a, b], prompt) == (b, "cache_hit")


def test_cache_aware_below_the_threshold_goes_to_the_least_loaded():
    a, b = FakeReplica("0", load=1), FakeReplica("1", load=0)
    a.index.apply(KvEventBatch(stored=_hashes(SYSTEM[:4])))  # 1 block of 9: under 0.5
    replica, reason = Router().choose([a, b], _hashes([*SYSTEM, 1, 2, 3, 4]))
    assert (replica, reason) == (b, "cache_miss")


def test_out_of_balance_overrides_the_cache():
    a, b = FakeReplica("0", load=40), FakeReplica("1", load=2)
    a.index.apply(KvEventBatch(stored=_hashes(SYSTEM)))
    router = Router(RouterConfig(balance_abs_threshold=32, balance_rel_threshold=1.5))
    assert router.choose([a, b], _hashes(SYSTEM)) == (b, "balance")
    a.load = 30  # 28 over the idlest: within the absolute threshold
    assert router.choose([a, b], _hashes(SYSTEM)) == (a, "cache_hit")


def test_a_cache_salt_changes_every_hash_so_no_cross_tenant_hit():
    a, b = FakeReplica("0", load=1), FakeReplica("1")
    a.index.apply(KvEventBatch(stored=_hashes(SYSTEM, salt="tenant-a")))
    assert Router().choose([a, b], _hashes(SYSTEM, salt="tenant-b"))[1] == "cache_miss"
    assert Router().choose([a, b], _hashes(SYSTEM, salt="tenant-a"))[1] == "cache_hit"


def test_least_loaded_and_round_robin():
    replicas = [FakeReplica("0", load=3), FakeReplica("1", load=1), FakeReplica("2", load=1)]
    least = Router(RouterConfig(policy="least_loaded"))
    picks = {least.choose(replicas)[0].name for _ in range(4)}
    assert picks == {"1", "2"}  # ties are taken in turn
    rr = Router(RouterConfig(policy="round_robin"))
    assert [rr.choose(replicas)[0].name for _ in range(6)] == ["0", "1", "2"] * 2


def test_back_to_back_first_turns_go_to_different_replicas():
    """The second conversation's first turn arrives before the first one's was stored:
    the prediction already counts, so it goes to the other (emptier) replica."""
    replicas = [FakeReplica("0"), FakeReplica("1")]
    replicas[0].index.predict(_hashes(SYSTEM))  # the first turn was just routed to 0
    second, reason = Router().choose(replicas, _hashes([t + 1 for t in SYSTEM]))
    assert (second.name, reason) == ("1", "cache_miss")  # a plain tie would pick 0


def test_unrelated_prompts_spread_over_equal_replicas():
    replicas = [FakeReplica("0"), FakeReplica("1")]
    router = Router()
    names = []
    for i in range(6):
        replica, reason = router.choose(replicas, _hashes([1000 * i + t for t in range(16)]))
        assert reason == "cache_miss"
        replica.load += 1  # it is now running there
        names.append(replica.name)
    assert names.count("0") == names.count("1") == 3


def test_predictions_count_until_confirmed_or_expired():
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0])
    hashes = _hashes(SYSTEM)
    index.predict(hashes)
    assert index.match(hashes) == len(hashes) and not index.confirmed  # predicted, not held
    assert len(index) == len(hashes)  # but counted as about to be held
    index.apply(KvEventBatch(stored=hashes[:2]))
    assert len(index.confirmed) == 2 and hashes[0] not in index.predicted
    now[0] = PREDICTION_TTL_S + 1
    assert index.match(hashes) == 2  # the predictions expired; the confirmed remain
    index.apply(KvEventBatch(removed=hashes[:1]))
    assert index.match(hashes) == 0
    index.predict(hashes)
    index.apply(KvEventBatch(reset=True))  # the engine's cache started over
    assert index.match(hashes) == 0


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"policy": "random"}, "router_policy"),
        ({"cache_threshold": 1.5}, "router_cache_threshold"),
        ({"balance_abs_threshold": -1}, "router_balance_abs_threshold"),
        ({"balance_rel_threshold": 0.5}, "router_balance_rel_threshold"),
    ],
)
def test_bad_router_settings_name_the_setting(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        RouterConfig(**kwargs)
