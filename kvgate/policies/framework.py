"""The scheduling framework's small interfaces: a Filter narrows candidates, a Scorer rates them, a Picker ranks.

Modelled on the Gateway API Inference Extension's scheduler: each signal is a tiny plugin tested
alone, and a profile (policies/profile.py) blends them with weights taken from configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvgate.endpoints.types import EndpointState
from kvgate.policies.types import RequestInfo


@dataclass(frozen=True, slots=True)
class Cycle:
    """One scheduling cycle: the request and what was computed about it once, shared by every plugin."""

    request: RequestInfo
    placement_key: int  # rendezvous key of the request's prefix (policies/rendezvous.py)
    matched_blocks: Mapping[str, int]  # endpoint key -> leading blocks it is believed to hold


class Filter(Protocol):
    """Narrows the candidates; never raises on missing or stale metrics."""

    name: str

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> tuple[EndpointState, ...]:
        """The candidates that may take this request, in their given order."""
        ...


class Scorer(Protocol):
    """Rates each candidate in [0, 1]; higher is better."""

    name: str
    pulls: Literal["locality", "spread"]  # whether it keeps work where its cache is or spreads it

    def score(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[float]:
        """One score per candidate, aligned with `candidates`."""
        ...


class Picker(Protocol):
    """Orders scored candidates from best to worst."""

    name: str

    def rank(self, cycle: Cycle, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[EndpointState]:
        """Candidates best first; the first is chosen, the rest are retry fallbacks."""
        ...
