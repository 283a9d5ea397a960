"""Filters: which candidates may take a request at all."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.capacity import has_free_seat, occupied
from kvgate.policies.framework import Cycle


def load_cap(loads: Sequence[float], load_bound: float, slack: int = 0, noise_sigmas: float = 0.0) -> float:
    """Consistent hashing with bounded loads: a replica may take one more request while its load is under this.

    ceil(c * (total + 1) / n) rather than c x mean, so that with tiny loads (0 or 1 in flight) every
    replica still has room for one request; with c >= 1 some replica is always under the cap. At least
    `slack` requests above the mean: at low load c x mean is within a request or two of the mean, and
    a bound that tight fires on noise (a gateway among several sees a third of the load, say), moving
    requests off the replica that caches their prefix when nothing is hot. With `noise_sigmas`, also at
    least that many standard deviations of a Poisson count (sqrt of the mean) above the mean, for a bound
    meant to catch hot spots only.
    """
    mean = (sum(loads) + 1) / len(loads)
    cap = math.ceil(load_bound * mean)
    if noise_sigmas:
        cap = max(cap, math.ceil(mean + noise_sigmas * math.sqrt(mean)))
    return max(cap, math.ceil(mean) + slack) if slack else cap


def under_cap(states: Sequence[EndpointState], load_bound: float, slack: int = 0,
              noise_sigmas: float = 0.0) -> tuple[EndpointState, ...]:
    """The states (in their order) whose load, what the replica holds (capacity.occupied), is under load_cap's cap."""
    loads = [occupied(state) for state in states]
    cap = load_cap(loads, load_bound, slack, noise_sigmas)
    return tuple(state for state, load in zip(states, loads) if load < cap)


class BoundedLoadFilter:
    """Keeps only the candidates whose load is under the bounded-load cap.

    A replica's load is what it holds, running or waiting (capacity.occupied: its last scrape moved by what was
    sent and finished since), not what this gateway has open there: every gateway reads the same figure, however
    many share the traffic, so they bound alike.
    """

    name = "bounded-load"

    def __init__(self, load_bound: float, slack: int = 0, noise_sigmas: float = 0.0) -> None:
        self.load_bound = load_bound
        self.slack = slack
        self.noise_sigmas = noise_sigmas

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> tuple[EndpointState, ...]:
        """Candidates that may take one more request without exceeding the bound."""
        if not candidates:
            return ()
        return under_cap(candidates, self.load_bound, self.slack, self.noise_sigmas)


class FreeSeatFilter:
    """Keeps the candidates with a free seat, or an unknown seat count, when there are any; else all of them.

    A request sent to a replica whose seats are all taken waits in its queue until another one finishes.
    """

    name = "free-seat"

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> tuple[EndpointState, ...]:
        """Candidates that can start the request at once, or every candidate when none can."""
        seated = tuple(state for state in candidates if has_free_seat(state))
        return seated or tuple(candidates)
