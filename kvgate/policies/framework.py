"""The scheduling framework's small interfaces: a Filter narrows candidates, a Picker ranks them.

Modelled on the Gateway API Inference Extension's scheduler: each step is a small plugin tested alone,
and a profile (policies/profile.py) chains them. The cache-aware profile ranks by one currency, the
request's expected cost in seconds (policies/cost.py), rather than by a weighted blend of unlike scores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.endpoints.types import EndpointState
from kvgate.policies.types import RequestInfo


@dataclass(frozen=True, slots=True)
class Cycle:
    """One scheduling cycle: the request and what was computed about it once, shared by every plugin."""

    request: RequestInfo
    placement_key: int  # rendezvous key of the request's prefix (policies/rendezvous.py)
    # endpoint key -> leading prompt tokens it is believed to hold, from whichever index knows the endpoint
    matched_tokens: Mapping[str, int]
    home: str | None = None  # where new context goes: where the fleet's history puts it, or its tenant's map home


class Filter(Protocol):
    """Narrows the candidates; never raises on missing or stale metrics."""

    name: str

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> tuple[EndpointState, ...]:
        """The candidates that may take this request, in their given order."""
        ...


class Picker(Protocol):
    """Orders candidates from best to worst."""

    name: str

    def rank(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        """Candidates best first; the first is chosen, the rest are retry fallbacks."""
        ...
