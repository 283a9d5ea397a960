"""HTTP handlers: the inference routes, /v1/models, health, readiness, metrics and the fleet view."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.router.auth import KEY_INFO
from kvgate.router.errors import GatewayError, error_response
from kvgate.router.ratelimit import estimate_tokens
from kvgate.router.gateway import Gateway
from kvgate.router.headers import request_id as make_request_id
from kvgate.router.preemption import Preempted
from kvgate.router.proxy import CLIENT_GONE, Outcome
from kvgate.router.requests import ParsedRequest, parse_request, with_upstream_priority
from kvgate.policies.priorities import fairness_id
from kvgate.policies.types import Decision

log = logging.getLogger(__name__)


def json_response(data: object, status: int = 200) -> web.Response:
    """A JSON response encoded with orjson."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class Handlers:
    """The gateway's HTTP surface, bound to one Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def inference(self, request: web.Request) -> web.StreamResponse:
        """Proxy one chat, completion or embedding request to the replica the policy picks."""
        gateway = self.gateway
        assert gateway.forwarder is not None and gateway.admission is not None
        outcome = Outcome(request_id=make_request_id(request.headers), arrived=time.monotonic())
        model = "-"
        try:
            key = request.get(KEY_INFO)
            priority_class = gateway.priority_class(request.headers, key.priority if key else None)
            raw = await self._read_body(request)
            parsed = parse_request(request.path, raw, priority_class, gateway.config.routing,
                                   fairness_id(request.headers))
            if gateway.tokenizer is not None:
                parsed = await gateway.tokenizer.tokenize(parsed)
            model = parsed.info.model
            if key is not None:
                gateway.limiter.admit(key, estimate_tokens(parsed))
            async with gateway.admitted(parsed) as decision:
                if gateway.config.upstream_priority:
                    parsed = with_upstream_priority(parsed, gateway.config.priorities.classes)
                response = await self._forward(request, parsed, decision, outcome)
        except GatewayError as error:
            outcome.status = error.status
            gateway.metrics.rejected.labels(str(error.status), error.param or "-").inc()
            response = error_response(error)
            response.headers["x-request-id"] = outcome.request_id
        except asyncio.CancelledError:
            outcome.status = CLIENT_GONE
            raise
        finally:
            self._finish(request, model, outcome)
        return response

    async def _forward(self, request: web.Request, parsed: ParsedRequest, decision: Decision,
                       outcome: Outcome) -> web.StreamResponse:
        """Proxy the request to `decision`; a preempted request queues again, is picked and sent anew."""
        gateway = self.gateway
        assert gateway.forwarder is not None and gateway.admission is not None
        info = parsed.info
        rank = gateway.config.priorities.classes.index(info.priority_class)
        preemptions = 0
        while True:
            preemptible = gateway.admission.preemptible(info, preemptions)
            try:
                return await gateway.forwarder.forward(request, parsed, decision, outcome,
                                                       rank if preemptible else None)
            except Preempted:
                preemptions += 1
                gateway.metrics.preempted.labels(info.priority_class).inc()
                log.info("preempted id=%s replica=%s class=%s times=%d", outcome.request_id, outcome.replica,
                         info.priority_class, preemptions)
                gateway.admission.release(info.model)  # its seat goes to the request that preempted it
                await gateway.admission.admit(info, preemptions)
                decision = gateway.forwarder.choose(parsed)

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body, at most max_body_bytes; 413 beyond."""
        limit = self.gateway.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise GatewayError(413, f"request body exceeds the limit of {limit} bytes")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(413, f"request body exceeds the limit of {limit} bytes") from None
        except (RequestPayloadError, HttpProcessingError):
            raise GatewayError(400, "the request body is malformed") from None

    def _finish(self, request: web.Request, model: str, outcome: Outcome) -> None:
        """Record the request's metrics and write its one log line."""
        metrics = self.gateway.metrics
        duration = time.monotonic() - outcome.arrived
        # Only models some replica serves become label values: clients must not be able to mint series.
        model_label = model if self.gateway.serves(model) else "other"
        metrics.requests.labels(request.path, model_label, str(outcome.status), outcome.replica).inc()
        metrics.duration.labels(request.path, model_label).observe(duration)
        if outcome.ttfb is not None:
            metrics.ttfb.labels(request.path, model_label).observe(outcome.ttfb)
        log.info("request id=%s path=%s model=%s replica=%s status=%s attempts=%d ttfb_ms=%s duration_ms=%.1f%s",
                 outcome.request_id, request.path, model, outcome.replica, outcome.status, outcome.attempts,
                 "-" if outcome.ttfb is None else f"{outcome.ttfb * 1000:.1f}", duration * 1000,
                 f" error={outcome.error}" if outcome.error else "")

    async def models(self, request: web.Request) -> web.Response:
        """The union of the models every replica serves, deduplicated by id."""
        assert self.gateway.models is not None
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
