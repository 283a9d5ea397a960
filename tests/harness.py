"""Starting gateways, discovery sources and scripted replicas on 127.0.0.1 for tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from kvgate.endpoints.discovery import Discovery
from kvgate.endpoints.types import Endpoint
from kvgate.router.config import build_config
from kvgate.router.gateway import Gateway, default_discovery
from kvgate.router.server import GatewayServer


class RunningGateway:
    """A gateway serving on a free loopback port."""

    def __init__(self, server: GatewayServer) -> None:
        self.server = server
        self.gateway = server.gateway
        host, port = server.addresses[0]
        self.url = f"http://{host}:{port}"
        self.admin_url = f"http://{server.addresses[1][0]}:{server.addresses[1][1]}" if len(server.addresses) > 1 \
            else self.url


@asynccontextmanager
async def running_gateway(discovery: Discovery | str | None = None, **settings: Any) -> AsyncIterator[RunningGateway]:
    """Run a gateway on 127.0.0.1 with `settings` (drain delay 0 unless given) until the block exits.

    `discovery` is a Discovery object to use, or the name of the configured kind ("static", "kubernetes").
    """
    if isinstance(discovery, str):
        settings["discovery"], discovery = discovery, None
    config = build_config({"listen": "127.0.0.1:0", "drain_delay": 0, "drain_timeout": 5, **settings})
    server = GatewayServer(config, Gateway(config, discovery or default_discovery(config)))
    await server.start()
    try:
        yield RunningGateway(server)
    finally:
        await server.drain()


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> None:
    """Poll `predicate` until it is true; fail the test after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


@asynccontextmanager
async def scripted_replica(routes: list[tuple[str, str, Callable]]) -> AsyncIterator[str]:
    """Serve an aiohttp app with the given (method, path, handler) routes on a free port; yields its URL."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def sse_event(payload: bytes) -> bytes:
    """One SSE event as vLLM frames it."""
    return b"data: " + payload + b"\n\n"


def closed_port() -> int:
    """A 127.0.0.1 port nobody listens on (bound once to find it, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Reports:
    """Records every on_change call; lets a test wait, with a deadline, for a condition on the latest one."""

    def __init__(self) -> None:
        self.history: list[list[Endpoint]] = []
        self._changed = asyncio.Event()

    def __call__(self, endpoints: Sequence[Endpoint]) -> None:
        self.history.append(list(endpoints))
        self._changed.set()

    @property
    def latest(self) -> dict[str, Endpoint]:
        return {e.key: e for e in self.history[-1]} if self.history else {}

    async def wait_for(self, condition: Callable[[dict[str, Endpoint]], bool], timeout: float = 3.0) -> float:
        """Seconds until `condition(latest)` held; fails the test after `timeout`."""
        start = time.monotonic()
        async with asyncio.timeout(timeout):
            while not condition(self.latest):
                self._changed.clear()
                await self._changed.wait()
        return time.monotonic() - start


@asynccontextmanager
async def running(discovery, reports: Reports) -> AsyncIterator[None]:
    task = asyncio.create_task(discovery.run(reports))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class FakeClock:
    """A settable monotonic clock, so code that reads time is tested without sleeping."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

