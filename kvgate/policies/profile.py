"""A scheduling profile: filters, then a picker, assembled from RoutingConfig."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.endpoints.types import EndpointState
from kvgate.policies.balance import NOISE_SIGMAS, RecentRequests, RecentShareFilter
from kvgate.policies.config import RoutingConfig
from kvgate.policies.cost import RequestCost
from kvgate.policies.filters import BoundedLoadFilter, FreeSeatFilter
from kvgate.policies.framework import Cycle, Filter, Picker
from kvgate.policies.pickers import LowestCostPicker


@dataclass(frozen=True)
class SchedulingProfile:
    """How candidates are narrowed and ranked."""

    filters: tuple[Filter, ...]
    picker: Picker

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> tuple[EndpointState, ...]:
        """Candidates that pass every filter."""
        remaining = tuple(candidates)
        for candidate_filter in self.filters:
            remaining = candidate_filter.filter(cycle, remaining)
        return remaining

    def ruled_out_by(self, cycle: Cycle, candidates: Sequence[EndpointState], key: str) -> str | None:
        """The name of the first filter that leaves the replica `key` out of the candidates; None when none does."""
        remaining = tuple(candidates)
        for candidate_filter in self.filters:
            remaining = candidate_filter.filter(cycle, remaining)
            if all(state.key != key for state in remaining):
                return candidate_filter.name
        return None

    def rank(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        """Candidates best first."""
        return self.picker.rank(cycle, candidates)


def _hot_spot_filter(config: RoutingConfig) -> BoundedLoadFilter:
    """In-flight load over `hot_spot_bound` x the mean and beyond three deviations of Poisson noise: a hot spot."""
    return BoundedLoadFilter(config.hot_spot_bound, config.load_slack, noise_sigmas=NOISE_SIGMAS)


def placement_profile(config: RoutingConfig, recent: RecentRequests) -> SchedulingProfile:
    """For a request whose own context no replica holds: a share of recent requests under the bound, no hot spot,
    a free seat when one exists, lowest cost."""
    return SchedulingProfile(
        filters=(RecentShareFilter(recent, config.load_bound, config.load_slack),
                 _hot_spot_filter(config), FreeSeatFilter()),
        picker=LowestCostPicker(RequestCost(config)),
    )


def continuation_profile(config: RoutingConfig) -> SchedulingProfile:
    """For a request whose context some replica holds: only a hot spot is ruled out, then lowest cost."""
    return SchedulingProfile(
        filters=(_hot_spot_filter(config),),
        picker=LowestCostPicker(RequestCost(config)),
    )
