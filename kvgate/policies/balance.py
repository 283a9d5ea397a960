"""Recent request shares: the balance a hot spot under skew breaks, judged over many requests instead of one instant.

In-flight counts swing with every Poisson burst: a bound on them fires on noise and moves requests off the
replica that caches their context when nothing is hot. A replica's share of the last few hundred requests
barely moves on noise, and rises above its fair share only when popularity is skewed toward what it holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.filters import load_cap
from kvgate.policies.framework import Cycle

# How far a share may wander on noise, in standard deviations, before the window is long enough.
NOISE_SIGMAS = 3.0


def balance_window(replicas: int, load_bound: float) -> int:
    """Requests a share is judged over: long enough that noise stays `NOISE_SIGMAS` deviations inside the bound.

    A fair share p = 1/n over W requests varies by sqrt(p (1 - p) / W); the bound allows (load_bound - 1) p
    above it. Three deviations inside that margin need W = 9 (n - 1) / (load_bound - 1)^2: 288 requests for
    three replicas at a bound of 1.25, about 1,000 for eight.
    """
    margin = max(load_bound - 1.0, 0.05)
    return max(1, math.ceil(NOISE_SIGMAS**2 * max(replicas - 1, 1) / margin**2))


class RecentRequests:
    """Per endpoint, the requests sent to it, each older one weighing (1 - 1/W) less per request sent since; and the
    requests pledged to it, decaying alike: a new tenant's expected share, which its own requests then replace."""

    def __init__(self) -> None:
        self._counts: dict[str, float] = {}
        self._pledged: dict[str, float] = {}

    def count(self, endpoint_key: str) -> float:
        """The endpoint's decayed count of recent requests."""
        return self._counts.get(endpoint_key, 0.0)

    def expected(self, endpoint_key: str) -> float:
        """The endpoint's recent requests and those pledged to it: the share it will have once new tenants settle."""
        return self._counts.get(endpoint_key, 0.0) + self._pledged.get(endpoint_key, 0.0)

    def record(self, endpoint_key: str, window: int) -> None:
        """One more request sent to the endpoint."""
        keep = 1.0 - 1.0 / window
        for decaying in (self._counts, self._pledged):
            for key in decaying:
                decaying[key] *= keep
        self._counts[endpoint_key] = self._counts.get(endpoint_key, 0.0) + 1.0

    def pledge(self, endpoint_key: str, requests: float) -> None:
        """A tenant new to the fleet went to the endpoint: count the decayed requests it is expected to bring, which
        fade as fast as its own requests add up (an average tenant's total stays level)."""
        self._pledged[endpoint_key] = self._pledged.get(endpoint_key, 0.0) + requests

    def forget(self, endpoint_key: str) -> None:
        """Drop an endpoint that left the fleet."""
        self._counts.pop(endpoint_key, None)
        self._pledged.pop(endpoint_key, None)


class RecentShareFilter:
    """Keeps the candidates whose share of recent requests is under the bounded-load cap (CHWBL on shares)."""

    name = "recent-share"

    def __init__(self, recent: RecentRequests, load_bound: float, slack: int) -> None:
        self._recent = recent
        self.load_bound = load_bound
        self.slack = slack

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> tuple[EndpointState, ...]:
        """Candidates that may take one more request without their recent share exceeding the bound."""
        counts = [self._recent.count(state.key) for state in candidates]
        if not counts:
            return ()
        cap = load_cap(counts, self.load_bound, self.slack)
        return tuple(state for state, count in zip(candidates, counts, strict=True) if count < cap)
