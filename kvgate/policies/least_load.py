"""Least load: the candidate holding the fewest requests (running or waiting), ties placed by the prefix."""

from __future__ import annotations

from kvgate.endpoints.types import FleetSnapshot
from kvgate.policies.config import RoutingConfig
from kvgate.policies.no_index import NoPrefixIndex
from kvgate.policies.rendezvous import least_loaded_order, placement_key
from kvgate.policies.types import Decision, RequestInfo


class LeastLoadPolicy(NoPrefixIndex):
    """Fewest requests held (capacity.occupied); equal loads broken by the rendezvous weight of the request's
    leading blocks."""

    name = "least-load"

    def __init__(self, config: RoutingConfig) -> None:
        self._affinity_blocks = config.affinity_blocks

    def pick(self, request: RequestInfo, fleet: FleetSnapshot) -> Decision | None:
        """The least loaded candidate; the others, least loaded first, as fallbacks."""
        candidates = fleet.candidates(request.model)
        if not candidates:
            return None
        ranked = least_loaded_order(placement_key(request, self._affinity_blocks), candidates)
        return Decision(ranked[0], "least_load", fallbacks=tuple(ranked[1:]))
