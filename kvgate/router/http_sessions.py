"""The gateway's HTTP client sessions: one to proxy requests, one to poll replicas' /metrics and /v1/models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp


class HttpSessions:
    """Both sessions, open while the gateway's lifecycle (aiohttp cleanup_ctx) runs."""

    def __init__(self) -> None:
        self._proxy: aiohttp.ClientSession | None = None
        self._poll: aiohttp.ClientSession | None = None

    def proxy(self) -> aiohttp.ClientSession:
        """The session requests go upstream on: no pool limit, bodies relayed as they are."""
        return self._open(self._proxy)

    def poll(self) -> aiohttp.ClientSession:
        """The session of the scraper and the model lister."""
        return self._open(self._poll)

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """Open both sessions for the body of the block."""
        self._proxy = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
        )
        self._poll = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        try:
            yield
        finally:
            await self._proxy.close()
            await self._poll.close()
            self._proxy = self._poll = None

    @staticmethod
    def _open(session: aiohttp.ClientSession | None) -> aiohttp.ClientSession:
        if session is None:
            raise RuntimeError("the gateway's HTTP sessions are used before its lifecycle opened them")
        return session
