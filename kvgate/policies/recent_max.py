"""The largest value seen within a sliding time window, in constant time per observation (amortized)."""

from __future__ import annotations

from collections import deque


class RecentMax:
    """The largest value observed within the last `window` seconds.

    A value is kept only while no larger one came after it, so the oldest kept is the largest, and each value is
    added and dropped once.
    """

    def __init__(self, window: float) -> None:
        self._window = window
        self._kept: deque[tuple[float, int]] = deque()  # (when, value): times rising, values falling

    def observe(self, now: float, value: int) -> None:
        """A value seen at `now`."""
        while self._kept and self._kept[-1][1] <= value:
            self._kept.pop()
        self._kept.append((now, value))

    def largest(self, now: float) -> int:
        """The largest value seen since `now - window`; 0 when none was."""
        while self._kept and self._kept[0][0] < now - self._window:
            self._kept.popleft()
        return self._kept[0][1] if self._kept else 0
