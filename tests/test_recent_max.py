"""The largest value seen within a sliding time window."""

from __future__ import annotations

from kvgate.policies.recent_max import RecentMax


def test_the_largest_value_is_kept_until_it_leaves_the_window() -> None:
    largest = RecentMax(window=10.0)
    assert largest.largest(0.0) == 0
    largest.observe(0.0, 500)
    largest.observe(1.0, 1700)
    largest.observe(2.0, 300)
    largest.observe(3.0, 900)
    assert largest.largest(5.0) == 1700
    assert largest.largest(11.5) == 900  # 1,700 was seen more than 10 s ago; 900 is the largest since
    assert largest.largest(13.5) == 0
