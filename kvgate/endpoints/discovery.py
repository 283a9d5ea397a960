"""Discovery: the source of truth for which endpoints exist and which may take new work."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from kvgate.endpoints.types import Endpoint

EndpointsCallback = Callable[[Sequence[Endpoint]], None]


@dataclass
class DiscoveryStatus:
    """Health of a discovery source, for /readyz, /debug/fleet and gateway metrics."""

    healthy: bool = True  # False while the source cannot be reached (the last known set keeps serving)
    synced: bool = False  # a first full list has been received
    restarts: int = 0  # watch streams restarted for any reason
    relists: int = 0  # full lists taken after the first
    last_event_at: float | None = None  # time.monotonic() of the last list or watch event
    detail: str = ""


def combined_status(statuses: list[DiscoveryStatus]) -> DiscoveryStatus:
    """Several sources' statuses as one: all healthy, all synced, counters summed, newest event."""
    event_times = [s.last_event_at for s in statuses if s.last_event_at is not None]
    return DiscoveryStatus(
        healthy=all(s.healthy for s in statuses),
        synced=all(s.synced for s in statuses),
        restarts=sum(s.restarts for s in statuses),
        relists=sum(s.relists for s in statuses),
        last_event_at=max(event_times, default=None),
        detail="; ".join(s.detail for s in statuses if s.detail),
    )


class Discovery(Protocol):
    """Reports the complete current endpoint set through a callback whenever it changes."""

    status: DiscoveryStatus

    async def run(self, on_change: EndpointsCallback) -> None:
        """Report endpoint sets until cancelled; each call replaces the previous set."""
        ...


def parse_endpoint_urls(urls: Sequence[str]) -> list[Endpoint]:
    """Turn `http://host:port` strings into endpoints keyed by their URL; raises ValueError for bad ones."""
    endpoints: list[Endpoint] = []
    for raw in urls:
        url = raw.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint {raw!r} is not an http(s)://host:port URL")
        if parts.path or parts.query or parts.fragment:
            raise ValueError(f"endpoint {raw!r} must not carry a path, query or fragment")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"endpoint {raw!r} has an invalid port") from exc
        endpoints.append(Endpoint(key=url, url=url))
    if len({e.key for e in endpoints}) != len(endpoints):
        raise ValueError("endpoint list names the same URL twice")
    return endpoints


class StaticDiscovery:
    """A fixed list of endpoint URLs, reported once."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self._endpoints = list(endpoints)
        self.status = DiscoveryStatus(healthy=True, synced=True)

    async def run(self, on_change: EndpointsCallback) -> None:
        """Report the list, then idle until cancelled."""
        on_change(self._endpoints)
        await asyncio.Event().wait()
