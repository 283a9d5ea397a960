"""Pieces shared by the periodic per-endpoint HTTP pollers (metrics scraper, model lister)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from kvgate.endpoints.types import Endpoint

# What a poll of a replica may expectedly fail with: refused or reset connections, timeouts,
# non-200 answers (PollError) and pages that do not parse (ValueError and its subclasses).
_EXPECTED_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, ValueError)


class PollError(ValueError):
    """A replica answered a poll with a status other than 200."""


async def fetch_body(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bytes:
    """The body of a 200 answer to `GET url`, the whole exchange bounded by `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        async with session.get(url) as response:
            if response.status != 200:
                raise PollError(f"status={response.status}")
            return await response.read()


def voided_keys(old: Mapping[str, Endpoint], new: Mapping[str, Endpoint]) -> list[str]:
    """Keys whose endpoint is gone from `new` or now has another URL: what was polled from them is void."""
    return [key for key, endpoint in old.items() if key not in new or new[key].url != endpoint.url]


def is_current(endpoints: Mapping[str, Endpoint], polled: Endpoint) -> bool:
    """Whether a poll of `polled` that just finished still speaks for an endpoint in `endpoints`."""
    current = endpoints.get(polled.key)
    return current is not None and current.url == polled.url


class OutageLog:
    """Logs when polling an endpoint starts and stops failing: once per transition, not once per poll."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        self._failures: dict[str, int] = {}  # endpoint key -> consecutive failed polls

    def failed(self, key: str, exc: Exception) -> None:
        """Counts a failed poll; logs only the first of a run of failures, with a traceback if it was unexpected."""
        count = self._failures.get(key, 0)
        if count == 0:
            self._log.warning("%s failing endpoint=%s reason=%s", self._what, key, _reason(exc),
                              exc_info=not isinstance(exc, _EXPECTED_ERRORS))
        self._failures[key] = count + 1

    def succeeded(self, key: str) -> None:
        """Ends a run of failures, logging the recovery."""
        count = self._failures.pop(key, 0)
        if count:
            self._log.info("%s recovered endpoint=%s failed_polls=%d", self._what, key, count)

    def forget(self, key: str) -> None:
        """Drops a removed endpoint's state without logging."""
        self._failures.pop(key, None)


def _reason(exc: Exception) -> str:
    """A one-line reason for a failed poll."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
