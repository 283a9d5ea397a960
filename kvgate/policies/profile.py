"""A scheduling profile: filters, weighted scorers and a picker, assembled from RoutingConfig.weights."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.endpoints.types import EndpointState
from kvgate.policies.config import RoutingConfig
from kvgate.policies.filters import BoundedLoadFilter
from kvgate.policies.framework import Cycle, Filter, Picker, Scorer
from kvgate.policies.pickers import MaxScorePicker
from kvgate.policies.scorers import SCORERS


@dataclass(frozen=True)
class SchedulingProfile:
    """How candidates are narrowed, rated and ranked."""

    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]  # (scorer, weight); weights need not sum to 1
    picker: Picker

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> tuple[EndpointState, ...]:
        """Candidates that pass every filter."""
        remaining = tuple(candidates)
        for candidate_filter in self.filters:
            remaining = candidate_filter.filter(cycle, remaining)
        return remaining

    def scores(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[float]:
        """Weighted sum of every scorer's score, per candidate."""
        totals = [0.0] * len(candidates)
        for scorer, weight in self.scorers:
            for i, score in enumerate(scorer.score(cycle, candidates)):
                totals[i] += weight * score
        return totals

    def rank(self, cycle: Cycle, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        """Candidates best first by weighted score."""
        return self.picker.rank(cycle, candidates, self.scores(cycle, candidates))


def build_profile(config: RoutingConfig) -> SchedulingProfile:
    """The cache-aware profile: bounded-load filter, the configured weighted scorers, max-score picker."""
    unknown = sorted(set(config.weights) - set(SCORERS))
    if unknown:
        raise ValueError(f"unknown scorer weights {unknown}; known scorers are {sorted(SCORERS)}")
    negative = sorted(name for name, weight in config.weights.items() if weight < 0)
    if negative:
        raise ValueError(f"scorer weights must be >= 0, got negative weights for {negative}")
    scorers = tuple((SCORERS[name](), float(weight)) for name, weight in config.weights.items() if weight > 0)
    return SchedulingProfile(filters=(BoundedLoadFilter(config.load_bound, config.load_slack),), scorers=scorers, picker=MaxScorePicker())
