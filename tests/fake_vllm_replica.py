"""A vLLM stand-in for poller tests: serves `/metrics` and `/v1/models` from mutable state on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvgate.endpoints.types import Endpoint
from kvgate.loadtest.kit.vllm_metrics_page import DEFAULT_MODEL, EngineLoad, render_vllm_metrics


def models_payload(*cards: tuple[str, str | None]) -> dict[str, Any]:
    """A `/v1/models` answer listing (id, parent) cards the way vLLM prints them."""
    return {"object": "list", "data": [
        {"id": model_id, "object": "model", "created": 1700000000, "owned_by": "vllm", "root": parent or model_id,
         "parent": parent, "max_model_len": 8192, "permission": []}
        for model_id, parent in cards]}


@dataclass
class FakeReplica:
    """One fake vLLM server: tests change `page`, `status` or `delay_s` between polls and read the counters."""

    page: str = field(default_factory=lambda: render_vllm_metrics([EngineLoad(running=1)] * 2))
    models: dict[str, Any] = field(default_factory=lambda: models_payload((DEFAULT_MODEL, None)))
    status: int = 200
    delay_s: float = 0.0
    hits: dict[str, int] = field(default_factory=lambda: {"/metrics": 0, "/v1/models": 0})
    in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""

    @property
    def endpoint(self) -> Endpoint:
        """The Endpoint discovery would report for this replica."""
        return Endpoint(key=self.url, url=self.url)

    def app(self) -> web.Application:
        """An aiohttp app serving this replica's state."""
        app = web.Application()
        app.router.add_get("/metrics", self._answer(lambda: web.Response(text=self.page, content_type="text/plain")))
        app.router.add_get("/v1/models", self._answer(lambda: web.json_response(self.models)))
        return app

    def _answer(self, ok: Callable[[], web.Response]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            self.hits[request.path] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)  # cancelled when the client gives up and disconnects
                if self.status != 200:
                    return web.json_response({"error": "injected"}, status=self.status)
                return ok()
            finally:
                self.in_flight -= 1
        return handler


ReplicaStarter = Callable[..., Awaitable[FakeReplica]]


@pytest.fixture
async def start_replica() -> AsyncIterator[ReplicaStarter]:
    """Starts FakeReplica servers on free 127.0.0.1 ports; stops them after the test."""
    servers: list[TestServer] = []

    async def start(**state: Any) -> FakeReplica:
        replica = FakeReplica(**state)
        server = TestServer(replica.app(), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        replica.url = str(server.make_url("")).rstrip("/")
        return replica

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session like the one the gateway shares between its pollers."""
    async with aiohttp.ClientSession() as client:
        yield client


def refused_endpoint() -> Endpoint:
    """An endpoint on a 127.0.0.1 port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return Endpoint(key=url, url=url)
