"""Forwarding one inference request to the chosen replica and streaming the answer back unbuffered."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvgate.endpoints.fleet import Fleet
from kvgate.endpoints.types import EndpointState
from kvgate.policies.types import Decision, RequestInfo
from kvgate.router.errors import GatewayError, error_body
from kvgate.router.headers import forwardable
from kvgate.router.metrics import NO_REPLICA, GatewayMetrics
from kvgate.router.preemption import PreemptionRegistry
from kvgate.router.requests import InferenceRequest

log = logging.getLogger(__name__)

# What vLLM answers a new request while it shuts down: the request provably did not start, so another replica may
# take it. Older versions answer 503 "Server is unavailable"; 0.32 drains in-flight requests and fails new ones
# with a 500 whose message is its closed executor's.
_VLLM_SHUTDOWN_ANSWERS = {503: b"Server is unavailable", 500: b"cannot schedule new futures after shutdown"}
_SSE = "text/event-stream"
_DECODED = frozenset({"content-encoding"})
_WHOLE_BODY_LIMIT = 1024 * 1024  # plain answers up to this size are relayed in one write
CLIENT_GONE = 499  # nginx's code for "client closed the request"; used in logs and metrics only


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """How long to wait for a replica: to connect, between two chunks, and in total (0 = no limit)."""

    connect: float
    idle: float
    total: float

    def client_timeout(self) -> aiohttp.ClientTimeout:
        """The aiohttp timeout for one upstream request."""
        return aiohttp.ClientTimeout(total=self.total or None, sock_connect=self.connect, sock_read=self.idle)


@dataclass
class Outcome:
    """What happened to one proxied request, for the log line and the metrics."""

    request_id: str = "-"
    arrived: float = 0.0  # time.monotonic() when the request arrived
    sent: float | None = None  # time.monotonic() when it was first sent to a replica (after admission)
    status: int = 0
    replica: str = NO_REPLICA
    reason: str = "-"  # the routing decision's reason (prefix_hit, cold, overflow, ...)
    matched: float = 0.0  # share of the prompt the chosen replica was taken to hold
    moved_by: str = ""  # an overflow's cause: the filter that ruled out where it would have gone, or cost
    ttfb: float | None = None
    error: str | None = None  # kind of upstream failure, if any
    attempts: int = 0

    def follow(self, decision: Decision) -> None:
        """Take the routing decision's reason, match and cause as what the request was sent by."""
        self.reason, self.matched, self.moved_by = decision.reason, decision.matched_fraction, decision.moved_by


class Retryable(Exception):
    """The replica provably did not start the request; another one may take it."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class Forwarder:
    """Sends a request to one replica and relays its answer chunk by chunk."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], fleet: Fleet,
                 routed: Callable[[RequestInfo, EndpointState], None],
                 metrics: GatewayMetrics, timeouts: UpstreamTimeouts, dropped_headers: frozenset[str] = frozenset(),
                 preemption: PreemptionRegistry | None = None) -> None:
        self._session = session
        self._fleet = fleet
        self._routed = routed  # the policy (and the peer gateways) learn where a request went
        self._metrics = metrics
        self._timeout = timeouts.client_timeout()
        # The gateway's own credentials never reach a replica, nor Content-Encoding: the server already
        # decoded a compressed request body, so what goes upstream is the plain body.
        self.dropped_headers = frozenset(dropped_headers) | _DECODED
        self._preemption = preemption

    async def attempt(self, http: web.Request, request: InferenceRequest, target: EndpointState,
                      headers: dict[str, str], outcome: Outcome, preemptible_rank: int | None) -> web.StreamResponse:
        """Send the request to `target` and relay its answer; Retryable when the replica provably did not start it.

        With `preemptible_rank` (its class), a more important request may take its seat until the replica
        answers: it raises Preempted then.
        """
        key = target.key
        self._fleet.acquire(key, request.info)
        self._routed(request.info, target)
        gauge = self._metrics.in_flight.labels(key)
        gauge.inc()
        upstream: aiohttp.ClientResponse | None = None
        try:
            opening = self._open(target, http, request, headers)
            if self._preemption is not None and preemptible_rank is not None:
                opening = self._preemption.unless_preempted(request.model, key, preemptible_rank, opening,
                                                              request.info)
            upstream, prefetched = await opening
            return await self._relay(http, upstream, prefetched, outcome)
        finally:
            gauge.dec()
            self._fleet.release(key, request.info)
            if upstream is not None:
                # An unfinished body means the client or the replica went away: drop the connection so
                # vLLM sees the disconnect and aborts the generation.
                if upstream.content.is_eof():
                    if upstream.status == 200:  # the engine finished it and counted its prompt's tokens
                        self._fleet.answered(key, request.info.prompt_chars)
                    upstream.release()
                else:
                    upstream.close()

    async def _open(self, target: EndpointState, http: web.Request, request: InferenceRequest,
                    headers: dict[str, str]) -> tuple[aiohttp.ClientResponse, bytes | None]:
        """Send the request; returns the response and its body when it had to be read already."""
        url = target.endpoint.url + http.rel_url.path_qs
        try:
            upstream = await self._session().post(url, data=request.upstream_body, headers=headers,
                                                  timeout=self._timeout, allow_redirects=False)
        except aiohttp.ClientConnectorError as exc:
            self._metrics.upstream_errors.labels("connect", target.key).inc()
            self._fleet.health.failure(target.key, "connect")
            log.warning("upstream connect failed replica=%s error=%s", target.key, exc.os_error or exc)
            raise Retryable("connect") from None
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            self._metrics.upstream_errors.labels("timeout", target.key).inc()
            self._fleet.health.failure(target.key, "timeout")
            raise GatewayError(504, "the replica did not answer in time") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # Closed or reset before the status line: nothing reached the client, and vLLM aborts a request
            # whose connection is gone (or is dead itself), so another replica may take it.
            self._metrics.upstream_errors.labels("disconnected", target.key).inc()
            log.warning("upstream disconnected before answering replica=%s error=%s", target.key, exc)
            raise Retryable("disconnected") from None
        except aiohttp.ClientError as exc:
            self._metrics.upstream_errors.labels("protocol", target.key).inc()
            raise GatewayError(502, f"the replica failed before answering: {type(exc).__name__}") from None
        if upstream.status in _VLLM_SHUTDOWN_ANSWERS:
            body = await upstream.read()
            upstream.release()
            if _VLLM_SHUTDOWN_ANSWERS[upstream.status] in body:
                self._fleet.health.failure(target.key, "replica_shutdown")  # it is leaving: stop choosing it
                raise Retryable("replica_shutdown")
            self._fleet.health.success(target.key)
            return upstream, body
        self._fleet.health.success(target.key)  # any answer, 4xx and 5xx included, means it is up
        return upstream, None

    async def _relay(self, http: web.Request, upstream: aiohttp.ClientResponse, prefetched: bytes | None,
                     outcome: Outcome) -> web.StreamResponse:
        """Write the replica's status, headers and body to the client as they arrive."""
        is_sse = upstream.content_type == _SSE
        length = upstream.content_length
        if not is_sse and prefetched is None and length is not None and length <= _WHOLE_BODY_LIMIT:
            # A small plain answer goes out in one write: status, headers and body together.
            try:
                prefetched = await upstream.read()
            except (asyncio.TimeoutError, aiohttp.ClientError):
                self._metrics.upstream_errors.labels("stream_broken", outcome.replica).inc()
                self._fleet.health.failure(outcome.replica, "stream_broken")
                raise GatewayError(502, "the replica failed while sending its answer") from None
            outcome.ttfb = time.monotonic() - outcome.arrived
            outcome.status = upstream.status
            response = web.Response(status=upstream.status, reason=upstream.reason, body=prefetched,
                                    headers=forwardable(upstream.headers))
            response.headers["x-request-id"] = outcome.request_id
            return response
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=forwardable(upstream.headers))
        response.headers["x-request-id"] = outcome.request_id
        if is_sse:
            response.headers["X-Accel-Buffering"] = "no"
            response.headers["Cache-Control"] = "no-cache"
        elif upstream.content_length is not None:
            response.content_length = upstream.content_length
        outcome.status = upstream.status
        await response.prepare(http)
        try:
            if prefetched is not None:
                outcome.ttfb = time.monotonic() - outcome.arrived
                await response.write(prefetched)
            else:
                async for chunk in upstream.content.iter_any():
                    if outcome.ttfb is None:
                        outcome.ttfb = time.monotonic() - outcome.arrived
                    await response.write(chunk)
        except ConnectionResetError:
            outcome.status = CLIENT_GONE  # the client left; closing the upstream aborts the generation
            return response
        except (asyncio.TimeoutError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError) as exc:
            kind = "idle_timeout" if isinstance(exc, asyncio.TimeoutError) else "stream_broken"
            outcome.error = kind
            self._metrics.upstream_errors.labels(kind, outcome.replica).inc()
            self._fleet.health.failure(outcome.replica, kind)
            log.warning("upstream failed mid-response replica=%s kind=%s", outcome.replica, kind)
            if is_sse:
                message = "the replica stopped answering mid-stream" if kind == "idle_timeout" else \
                    "the replica connection broke mid-stream"
                await response.write(b"data: " + error_body(502, message) + b"\n\ndata: [DONE]\n\n")
            else:
                # A truncated plain body cannot be repaired; closing tells the client it is incomplete.
                http.transport.close()
                return response
        await response.write_eof()
        return response
