"""A count of recent events that decays with age."""

from __future__ import annotations

import math

from kvgate.policies.recent_count import RecentCount


def test_events_weigh_less_as_they_age_and_two_counts_compare_as_rates() -> None:
    arrivals, ends = RecentCount(window=10.0), RecentCount(window=10.0)
    assert arrivals.count(0.0) == 0.0
    for tick in range(100):  # 3 arrivals and 5 ends a second for 20 s
        now = tick * 0.2
        ends.add(now)
        if tick % 5 in (0, 2, 4):
            arrivals.add(now)
    assert math.isclose(arrivals.count(20.0) / ends.count(20.0), 0.6, rel_tol=0.05)
    assert math.isclose(ends.count(30.0), ends.count(20.0) / math.e)  # a window later, each counts 1/e as much
    assert ends.count(200.0) < 1e-6
