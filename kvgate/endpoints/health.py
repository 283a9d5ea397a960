"""Passive health: a circuit breaker per replica, fed by the outcome of real requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class _Breaker:
    failures: int = 0
    open_until: float = 0.0
    backoff: float = 0.0


class PassiveHealth:
    """Takes a replica out of rotation after consecutive connect failures or timeouts, for a growing backoff.

    When the backoff ends the replica is tried again with real traffic (half-open): one more failure
    re-opens it for twice as long, a success closes the breaker.
    """

    def __init__(self, threshold: int = 3, base_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._threshold = threshold
        self._base = base_backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._breakers: dict[str, _Breaker] = {}
        self.version = 0  # bumped whenever a breaker opens or closes, so cached views know to refresh

    def healthy(self, key: str) -> bool:
        """False while the replica's breaker is open."""
        breaker = self._breakers.get(key)
        return breaker is None or self._clock() >= breaker.open_until

    def failure(self, key: str, kind: str) -> None:
        """A connect failure or timeout on `key`."""
        breaker = self._breakers.setdefault(key, _Breaker())
        if self._clock() < breaker.open_until:
            return  # already out of rotation: requests that were in flight when it broke add no news
        breaker.failures += 1
        half_open = breaker.backoff > 0
        if half_open or breaker.failures >= self._threshold:
            breaker.backoff = min(self._max, breaker.backoff * 2 if half_open else self._base)
            breaker.open_until = self._clock() + breaker.backoff
            self.version += 1
            log.warning("replica out of rotation key=%s kind=%s failures=%d backoff_s=%.1f", key, kind,
                        breaker.failures, breaker.backoff)

    def success(self, key: str) -> None:
        """The replica answered: close its breaker."""
        breaker = self._breakers.pop(key, None)
        if breaker is None:
            return
        self.version += 1
        if breaker.backoff > 0:
            log.info("replica back in rotation key=%s", key)

    def forget(self, key: str) -> None:
        """Drop the state of a replica that left the fleet."""
        self._breakers.pop(key, None)

    def open_keys(self) -> list[str]:
        """Replicas out of rotation now."""
        return [key for key in self._breakers if not self.healthy(key)]
