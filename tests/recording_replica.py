"""A stand-in vLLM replica that records every request beyond its polled pages, to assert what got through."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDictProxy

from kvgate.loadtest.kit.vllm_metrics_page import EngineLoad, render_vllm_metrics
from tests.fake_vllm_replica import models_payload
from tests.harness import scripted_replica

MODEL = "test-model"


@dataclass(frozen=True)
class Received:
    """One request as the replica saw it."""

    method: str
    path_qs: str
    headers: CIMultiDictProxy[str]
    body: bytes


class RecordingReplica:
    """Answers every request with a small completion and keeps it in `received`; serves /metrics and /v1/models."""

    def __init__(self) -> None:
        self.url = ""
        self.received: list[Received] = []

    def routes(self) -> list[tuple[str, str, object]]:
        """The aiohttp routes of this replica."""
        return [("GET", "/metrics", self._metrics), ("GET", "/v1/models", self._models),
                ("*", "/{tail:.*}", self._record)]

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_vllm_metrics([EngineLoad()], model=MODEL), content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_payload((MODEL, None)))

    async def _record(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.method, request.path_qs, request.headers, await request.read()))
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})


@asynccontextmanager
async def recording_replica() -> AsyncIterator[RecordingReplica]:
    """Run a RecordingReplica on a free loopback port until the block exits."""
    replica = RecordingReplica()
    async with scripted_replica(replica.routes()) as url:
        replica.url = url
        yield replica
