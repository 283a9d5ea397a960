"""Pickers: order scored candidates, best first."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.framework import Cycle
from kvgate.policies.rendezvous import rendezvous_weight


class MaxScorePicker:
    """Highest score first; equal scores in the rendezvous order of the request's prefix, never by position.

    Breaking ties by rendezvous rather than at random keeps every gateway replica's choice the same
    and sends a prefix that ties everywhere to its home.
    """

    name = "max-score"

    def rank(self, cycle: Cycle, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[EndpointState]:
        """Candidates by score descending, then by rendezvous weight descending."""
        order = sorted(
            range(len(candidates)),
            key=lambda i: (-scores[i], -rendezvous_weight(cycle.placement_key, candidates[i].key), candidates[i].key),
        )
        return [candidates[i] for i in order]
