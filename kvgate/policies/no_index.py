"""The learning half of the Policy protocol for policies that keep no prefix index."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.endpoints.types import EndpointState, FleetSnapshot
from kvgate.policies.types import RequestInfo


class NoPrefixIndex:
    """No-op record/learn/forget and an empty index, for policies whose choices need no record of past requests."""

    def record(self, request: RequestInfo, chosen: EndpointState) -> None:
        """Nothing to learn."""

    def learn(self, request: RequestInfo, chosen: EndpointState, fleet: FleetSnapshot) -> None:
        """Nothing to learn from other gateways either."""

    def forget(self, endpoint_key: str) -> None:
        """Nothing to drop."""

    def holders(self, request: RequestInfo, candidates: Sequence[EndpointState], now: float) -> frozenset[str]:
        """No prefix index: no replica is known to hold a prompt."""
        return frozenset()

    def index_sizes(self) -> dict[str, int]:
        """No prefix index."""
        return {}

    def index_bytes(self) -> int:
        """No prefix index."""
        return 0
