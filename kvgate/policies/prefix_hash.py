"""Prefix hash: consistent hashing with bounded loads (CHWBL) on the prompt's leading blocks.

Stateless: every gateway replica sends a prefix to the same place. Reasons: "cold" when the
prefix's rendezvous home takes it, "overflow" when a later replica in its order does because the
home was at the load cap, "fallback" when every candidate was (only possible with load_bound < 1).
"""

from __future__ import annotations

from kvgate.endpoints.types import FleetSnapshot
from kvgate.policies.config import RoutingConfig
from kvgate.policies.filters import BoundedLoadFilter, under_cap
from kvgate.policies.no_index import NoPrefixIndex
from kvgate.policies.rendezvous import least_loaded_order, placement_key, rendezvous_order, retry_order
from kvgate.policies.types import Decision, RequestInfo


class PrefixHashPolicy(NoPrefixIndex):
    """The first candidate in the rendezvous order of the leading `affinity_blocks` blocks whose load is under the cap."""

    name = "prefix-hash"

    def __init__(self, config: RoutingConfig) -> None:
        self._affinity_blocks = config.affinity_blocks
        self._load_bound = config.load_bound
        self._load_slack = config.load_slack

    def pick(self, request: RequestInfo, fleet: FleetSnapshot) -> Decision | None:
        """Walk the prefix's rendezvous order to the first replica under the bounded-load cap."""
        candidates = fleet.candidates(request.model)
        if not candidates:
            return None
        key = placement_key(request, self._affinity_blocks)
        order = rendezvous_order(key, candidates)
        eligible = under_cap(order, self._load_bound, self._load_slack)
        if not eligible:
            ranked = least_loaded_order(key, candidates)
            return Decision(ranked[0], "fallback", fallbacks=tuple(ranked[1:]))
        cold = eligible[0] is order[0]
        return Decision(eligible[0], "cold" if cold else "overflow", fallbacks=retry_order(key, eligible, candidates),
                        moved_by="" if cold else BoundedLoadFilter.name)
