"""Router: which data-parallel replica (engine core) takes a request.

Policies (`--router-policy`): cache_aware (the default: SGLang's, on chained block
hashes), least_loaded, round_robin; Router says how each chooses. A replica's load is the
larger of what its engine core last reported (running + waiting) and the requests this
router has sent it that have not ended.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.block_hash import BlockHash
from services.common.flags import flag

ROUTER_POLICIES = ("cache_aware", "least_loaded", "round_robin")
# Why a request went where it went (the `reason` label of pagestream:router_requests_total).
REASONS = ("cache_hit", "cache_miss", "balance", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = flag(
        "cache_aware",
        "with several schedulers: cache_aware (the replica holding the longest cached "
        "prefix unless the load is out of balance), least_loaded, or round_robin",
        name="router-policy",
        choices=ROUTER_POLICIES,
    )
    # SGLang's cache-aware router defaults.
    cache_threshold: float = flag(
        0.5,
        "cache_aware: the cached fraction of a prompt's blocks that sends it to the replica "
        "holding them (below it: the least loaded replica)",
        name="router-cache-threshold",
    )
    balance_abs_threshold: int = flag(
        32,
        "cache_aware: route by load alone while the busiest replica has more than this many "
        "requests over the idlest ...",
        name="router-balance-abs-threshold",
    )
    balance_rel_threshold: float = flag(
        1.0001,
        "... and more than this many times the idlest's load",
        name="router-balance-rel-threshold",
    )

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}."
            )
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(
                f"router_cache_threshold must be in [0, 1], got {self.cache_threshold}."
            )
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"router_balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}."
            )
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"router_balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}."
            )


class RoutingTarget(Protocol):
    @property
    def load(self) -> int: ...

    @property
    def cached_blocks(self) -> int: ...

    def matched_blocks(self, hashes: Sequence[BlockHash]) -> float: ...


class Router:
    """How each policy (`--router-policy`) chooses:

    - cache_aware (default), SGLang's cache-aware policy on chained block hashes: when the
      replicas are out of balance (max load - min load > balance_abs_threshold and max load >
      min load * balance_rel_threshold) the least loaded one; otherwise the replica holding
      the longest cached prefix if it covers at least cache_threshold of the prompt's full
      blocks (a block its KV offload tiers hold counts prefix_index.OFFLOAD_WEIGHT);
      otherwise the least loaded (ties: the emptiest cache, then in turn).
    - least_loaded: fewest running + waiting requests (ties in turn).
    - round_robin: in turn.
    """

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._turn = itertools.count()

    @property
    def needs_hashes(self) -> bool:
        return self.config.policy == "cache_aware"

    def choose(self, replicas: Sequence[RoutingTarget], hashes: Sequence[BlockHash] = ()):
        """(replica, reason) for a request whose prompt has these full-block hashes."""
        if not replicas:
            raise ValueError("no replica to route to")
        policy = self.config.policy
        if policy == "round_robin":
            return replicas[next(self._turn) % len(replicas)], "round_robin"
        if policy == "least_loaded":
            return self._least_loaded(replicas), "least_loaded"
        if self._out_of_balance(replicas):
            return self._least_loaded(replicas), "balance"
        return self._cache_aware(replicas, hashes)

    def _out_of_balance(self, replicas: Sequence[RoutingTarget]) -> bool:
        loads = [r.load for r in replicas]
        high, low = max(loads), min(loads)
        c = self.config
        return high - low > c.balance_abs_threshold and high > low * c.balance_rel_threshold

    def _cache_aware(self, replicas: Sequence[RoutingTarget], hashes: Sequence[BlockHash]):
        if hashes:
            matched = [r.matched_blocks(hashes) for r in replicas]
            best = max(matched)
            if best > 0 and best / len(hashes) >= self.config.cache_threshold:
                holders = [r for r, m in zip(replicas, matched, strict=True) if m == best]
                return self._least_loaded(holders), "cache_hit"
        return self._least_loaded(replicas, by_cache=True), "cache_miss"

    def _least_loaded(self, replicas: Sequence[RoutingTarget], by_cache: bool = False):
        """Fewest requests; ties by the emptiest cache (by_cache), then in turn."""

        def key(r):
            return (r.load, r.cached_blocks if by_cache else 0)

        lowest = min(key(r) for r in replicas)
        tied = [r for r in replicas if key(r) == lowest]
        return tied[next(self._turn) % len(tied)]
