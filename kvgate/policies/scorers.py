"""Scorers: each rates every candidate in [0, 1] from one signal.

Stale metrics never remove a candidate: a replica whose last scrape is stale scores a neutral 0.5
on the signals that come from scrapes (KV cache, queue), between the best and the worst fresh
replica, so that it neither attracts work because it looks idle nor loses its cache affinity
because one scrape failed. The gateway's own in-flight counts are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.framework import Cycle, Scorer

STALE_SCORE = 0.5


class PrefixScorer:
    """Share of the request's blocks the candidate is believed to hold."""

    name = "prefix"
    pulls = "locality"

    def score(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[float]:
        """matched blocks / request blocks; 0 for a request without blocks."""
        total = len(cycle.request.block_hashes)
        if not total:
            return [0.0] * len(candidates)
        return [min(cycle.matched_blocks.get(state.key, 0) / total, 1.0) for state in candidates]


class KvCacheScorer:
    """Free KV cache: 1 - kv_cache_usage."""

    name = "kv_cache"
    pulls = "spread"

    def score(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[float]:
        """Free fraction of the KV cache, clamped to [0, 1]; neutral when stale."""
        return [
            STALE_SCORE if state.metrics.stale else min(max(1.0 - state.metrics.kv_cache_usage, 0.0), 1.0)
            for state in candidates
        ]


class QueueScorer:
    """Short waiting queues: 1 for the emptiest, 0 for the longest among fresh candidates."""

    name = "queue"
    pulls = "spread"

    def score(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[float]:
        """1 - waiting / longest waiting queue; neutral when stale."""
        fresh = [state for state in candidates if not state.metrics.stale]
        spread = _relative_to_max(fresh, lambda state: state.metrics.waiting)
        return [STALE_SCORE if state.metrics.stale else spread(state) for state in candidates]


class LoadScorer:
    """Few requests in flight from this gateway: 1 for the least busy, 0 for the busiest."""

    name = "load"
    pulls = "spread"

    def score(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[float]:
        """1 - in_flight / largest in_flight."""
        spread = _relative_to_max(candidates, lambda state: state.in_flight)
        return [spread(state) for state in candidates]


def _relative_to_max(
    states: Sequence[EndpointState], amount: Callable[[EndpointState], int]
) -> Callable[[EndpointState], float]:
    """A function scoring a state 1 - amount / max amount over `states` (1 when every amount is 0)."""
    largest = max((amount(state) for state in states), default=0)
    if largest <= 0:
        return lambda state: 1.0
    return lambda state: min(max(1.0 - amount(state) / largest, 0.0), 1.0)


SCORERS: dict[str, Callable[[], Scorer]] = {scorer.name: scorer for scorer in (PrefixScorer, KvCacheScorer, QueueScorer, LoadScorer)}
