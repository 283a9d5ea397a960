"""Pickers: order candidates, best first."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.cost import RequestCost
from kvgate.policies.framework import Cycle
from kvgate.policies.rendezvous import rendezvous_weight

# Costs closer than this (a tenth of a millisecond) are equal: the rendezvous order decides, not float noise.
COST_RESOLUTION_SECONDS = 1e-4


class LowestCostPicker:
    """Cheapest expected time to first token first; equal costs at the cycle's assigned home first, then in the
    rendezvous order of the request's prefix.

    Breaking ties by assignment and rendezvous rather than at random or by position keeps every gateway
    replica's choice the same and sends a prefix nobody holds, on an evenly loaded fleet, to its home.
    """

    name = "lowest-cost"

    def __init__(self, cost: RequestCost) -> None:
        self._cost = cost

    def rank(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        """Candidates by cost ascending, then the assigned home, then by rendezvous weight descending."""

        costs = self._cost.seconds_each(cycle.request, cycle.matched_tokens, candidates)

        def order(state: EndpointState) -> tuple[int, bool, int, str]:
            return (round(costs[state.key] / COST_RESOLUTION_SECONDS), state.key != cycle.home,
                    -rendezvous_weight(cycle.placement_key, state.key), state.key)

        return sorted(candidates, key=order)
