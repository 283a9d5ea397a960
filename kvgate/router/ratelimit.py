"""Per-key budgets of requests and tokens per minute: token buckets refilled continuously, read off a given clock."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.router.auth import KeyInfo
from kvgate.router.errors import GatewayError
from kvgate.router.requests import InferenceRequest

# A prompt's size counts text characters and 4 per token id (policies' TOKEN_BYTES); text runs about
# 4 characters per token, so one divisor estimates both.
CHARS_PER_TOKEN = 4


def estimate_tokens(request: InferenceRequest) -> int:
    """Tokens a request may cost: its prompt estimated from its size, plus the completion tokens it asks for."""
    return math.ceil(request.info.prompt_chars / CHARS_PER_TOKEN) + request.completion_tokens


@dataclass(slots=True)
class _Bucket:
    """Holds up to one minute's allowance and refills at allowance/60 per second."""

    capacity: float
    level: float
    updated: float

    def refill(self, now: float, capacity: float) -> None:
        # A reload may change the limit: the new capacity applies from now on.
        self.level = min(capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.capacity = capacity
        self.updated = now

    def wait_for(self, cost: float) -> float:
        """Seconds until `cost` fits; 0 when it fits now."""
        return max(0.0, (cost - self.level) * 60.0 / self.capacity)


class RateLimiter:
    """Requests-per-minute and tokens-per-minute buckets for each key name; pure logic, no I/O, no threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def check(self, key: KeyInfo, tokens: int) -> float | None:
        """Take one request and `tokens` from the key's budgets; if they do not fit, take nothing and
        return the seconds until they would."""
        now = self._clock()
        demands = []
        for budget, limit, cost in (("requests", key.requests_per_minute, 1),
                                    ("tokens", key.tokens_per_minute, tokens)):
            if limit is not None:
                # A request larger than a whole minute's budget waits for a full bucket and empties it.
                demands.append((self._bucket(key.name, budget, limit, now), min(cost, limit)))
        wait = max((bucket.wait_for(cost) for bucket, cost in demands), default=0.0)
        if wait > 0:
            return wait
        for bucket, cost in demands:
            bucket.level -= cost
        return None

    def admit(self, key: KeyInfo, tokens: int) -> None:
        """check(), raising the 429 (OpenAI RateLimitError, with Retry-After) when the key is over its limits."""
        wait = self.check(key, tokens)
        if wait is None:
            return
        seconds = max(1, math.ceil(wait))
        limits = ", ".join(f"{limit} {unit} per minute" for limit, unit in (
            (key.requests_per_minute, "requests"), (key.tokens_per_minute, "tokens")) if limit is not None)
        raise GatewayError(429, f"rate limit reached for API key {key.name!r} ({limits}); retry in {seconds} s",
                           headers={"Retry-After": str(seconds)})

    def _bucket(self, name: str, budget: str, limit: int, now: float) -> _Bucket:
        bucket = self._buckets.get((name, budget))
        if bucket is None:
            bucket = self._buckets[(name, budget)] = _Bucket(capacity=limit, level=limit, updated=now)
        else:
            bucket.refill(now, limit)
        return bucket
