"""Round robin: each pick takes the next candidate in key order after the previous pick's."""

from __future__ import annotations

from bisect import bisect_right

from kvgate.endpoints.types import FleetSnapshot
from kvgate.policies.config import RoutingConfig
from kvgate.policies.no_index import NoPrefixIndex
from kvgate.policies.types import Decision, RequestInfo


class RoundRobinPolicy(NoPrefixIndex):
    """Rotation over the candidates sorted by key; fair as candidates come and go.

    The rotation advances on pick rather than record, so that picks made before their requests are
    recorded (while connecting) still rotate.
    """

    name = "round-robin"

    def __init__(self, config: RoutingConfig) -> None:
        self._previous_key: str | None = None

    def pick(self, request: RequestInfo, fleet: FleetSnapshot) -> Decision | None:
        """The candidate whose key follows the previously picked key, wrapping around."""
        candidates = sorted(fleet.candidates(request.model), key=lambda state: state.key)
        if not candidates:
            return None
        start = 0
        if self._previous_key is not None:
            start = bisect_right([state.key for state in candidates], self._previous_key) % len(candidates)
        rotation = candidates[start:] + candidates[:start]
        self._previous_key = rotation[0].key
        return Decision(rotation[0], "round_robin", fallbacks=tuple(rotation[1:]))
