"""HTTP handlers besides inference (router/pipeline.py): /v1/models, health, readiness, metrics and the fleet view."""

from __future__ import annotations

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.router.gateway import Gateway


def json_response(data: object, status: int = 200) -> web.Response:
    """A JSON response encoded with orjson."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class Handlers:
    """The gateway's HTTP surface, bound to one Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def models(self, request: web.Request) -> web.Response:
        """The union of the models every replica serves, deduplicated by id."""
        return json_response({"object": "list", "data": self.gateway.models.model_cards()})

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the event loop answers."""
        return json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: 200 while not draining and at least one replica is routable."""
        ready, reason = self.gateway.ready()
        discovery = self.gateway.discovery.status
        # An unreachable API server does not fail readiness: the last known replicas keep serving.
        return json_response({"status": "ok" if ready else "unavailable", "reason": reason,
                              "discovery": {"healthy": discovery.healthy, "synced": discovery.synced,
                                            "detail": discovery.detail}},
                             status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """The gateway's Prometheus metrics."""
        body = generate_latest(self.gateway.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def debug_fleet(self, request: web.Request) -> web.Response:
        """JSON view of replicas, their scraped metrics, staleness and the policy's state."""
        return json_response(self.gateway.describe())
