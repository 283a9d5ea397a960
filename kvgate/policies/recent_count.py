"""How often something happened lately: a count that decays with age, in constant time and memory."""

from __future__ import annotations

import math


class RecentCount:
    """Events counted with weight exp(-age / window): those of about the last `window` seconds, an older one counting
    less the older it is, so that two counts of one window compare as the rates of what they count."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._count = 0.0
        self._at = 0.0  # when _count was last brought up to date

    def add(self, now: float) -> None:
        """One event at `now`."""
        self._count = self.count(now) + 1.0
        self._at = now

    def count(self, now: float) -> float:
        """The events seen, each weighed by its age at `now`; 0.0 when none was."""
        return self._count * math.exp(-max(0.0, now - self._at) / self._window) if self._count else 0.0
