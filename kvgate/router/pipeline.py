"""The life of one inference request, in one place: read, admit, pick, forward, record.

    handle(): read() -> admitted() [admission queue, then decide() on one fleet snapshot] -> forward() -> record()

The HTTP proxy runs every stage; the endpoint picker (router/picker.py) runs read() and admitted() and lets
Envoy forward. forward() is the one loop that sends a request again: to the policy's next fallback when a
replica failed before answering, or through admission and a new decision when a more important request
preempted it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvgate.policies.capacity import ClassStanding, with_room
from kvgate.policies.types import Decision
from kvgate.router.auth import KEY_INFO, KeyInfo
from kvgate.router.errors import GatewayError, error_response
from kvgate.router.gateway import Gateway
from kvgate.router.headers import forwardable, request_id as make_request_id
from kvgate.router.preemption import Preempted
from kvgate.router.priority_headers import PriorityError, classify, fairness_id
from kvgate.router.proxy import CLIENT_GONE, Outcome, Retryable
from kvgate.router.ratelimit import estimate_tokens
from kvgate.router.requests import InferenceRequest, parse_request

log = logging.getLogger(__name__)


class RequestPipeline:
    """Runs inference requests through the gateway's parts."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def handle(self, http: web.Request) -> web.StreamResponse:
        """Proxy one chat, completion or embedding request to the replica the policy picks."""
        outcome = Outcome(request_id=make_request_id(http.headers), arrived=time.monotonic())
        request: InferenceRequest | None = None
        try:
            request = await self.read(http.path, http.headers, await _body(http, self.gateway.config.max_body_bytes),
                                      http.get(KEY_INFO))
            async with self.admitted(request) as decision:
                response = await self.forward(http, request, decision, outcome)
        except GatewayError as error:
            response = self.refuse(error, outcome)
        except asyncio.CancelledError:
            outcome.status = CLIENT_GONE
            raise
        finally:
            self.record(http.path, request, outcome)
        return response

    async def read(self, path: str, headers: Mapping[str, str], raw: bytes, key: KeyInfo | None) -> InferenceRequest:
        """The request read once: its class, its body checked and hashed, its token ids, its key's budget charged."""
        gateway = self.gateway
        priorities = gateway.config.priorities
        try:
            # only InferencePool discovery knows objectives
            priority_class = classify(headers, priorities, key.priority if key else None,
                                      getattr(gateway.discovery, "objectives", None))
        except PriorityError as exc:
            raise GatewayError(400, str(exc), param=exc.header) from None
        request = parse_request(path, raw, priority_class, priorities.rank(priority_class), gateway.config.routing,
                                fairness_id(headers), gateway.config.upstream_priority)
        if gateway.tokenizer is not None:
            request = await gateway.tokenizer.tokenize(request)
        request = request.at_rate(gateway.fleet.chars_per_token(request.model))
        if key is not None:
            gateway.limiter.admit(key, estimate_tokens(request))
        return request

    @asynccontextmanager
    async def admitted(self, request: InferenceRequest, subset: Collection[str] | None = None
                       ) -> AsyncIterator[Decision]:
        """The request past the model check and the admission queue, with the policy's decision.

        404 for a model no replica serves, 429 when the queue sheds it, 503 when no replica (of `subset`,
        `host:port` addresses, when given) can take it. Its admission is released when the block exits.
        """
        gateway = self.gateway
        if not gateway.serves(request.model) and gateway.models_known():
            raise GatewayError(404, f"The model `{request.model}` does not exist.", param="model")
        standing = await gateway.admission.admit(request.info, request.rank)
        try:
            yield self.decide(request, subset, standing)
        finally:
            gateway.admission.release(request.model)

    def decide(self, request: InferenceRequest, subset: Collection[str] | None = None,
               standing: ClassStanding | None = None) -> Decision:
        """The policy's choice on one snapshot of the fleet (of `subset` when given); 503 when nothing can take it.

        While other classes have traffic (its `standing` in admission), a request chooses among the replicas
        with room for it and KV blocks free for its prompt, when any has: admission counts room over the whole
        fleet, and a request sent where there is none waits inside that replica, first come first served,
        behind less important ones or ahead of more important ones.
        """
        gateway = self.gateway
        snapshot = gateway.fleet.snapshot()
        if subset is not None:
            snapshot = snapshot.restricted(lambda state: state.endpoint.address in subset)
        if standing is not None and not standing.alone:
            roomy = with_room(snapshot.candidates(request.model), gateway.config.saturation, standing,
                              gateway.fleet.prompt_tokens(request.info))
            if roomy:
                snapshot = snapshot.restricted(lambda state: state.key in roomy)
        decision = gateway.policy.pick(request.info, snapshot)
        if decision is None:
            raise GatewayError(503, "no replica can take this request now; retry shortly",
                               headers={"Retry-After": "1"})
        gateway.metrics.decisions.labels(gateway.policy.name, decision.reason).inc()
        if decision.moved_by:
            gateway.metrics.overflows.labels(gateway.policy.name, decision.moved_by).inc()
        gateway.metrics.matched_fraction.observe(decision.matched_fraction)
        return decision

    async def forward(self, http: web.Request, request: InferenceRequest, decision: Decision,
                      outcome: Outcome) -> web.StreamResponse:
        """Send the request to `decision`, and again while nothing reached the client.

        A replica that provably did not start it (refused connection, closed before answering, shutting down)
        gives way to the decision's next fallback, up to `retries` times; a preempted request queues again
        and is sent where a new decision says.
        """
        gateway = self.gateway
        headers = forwardable(http.headers, gateway.forwarder.dropped_headers)
        headers["x-request-id"] = outcome.request_id
        targets = iter((decision.endpoint, *decision.fallbacks))
        outcome.follow(decision)
        outcome.sent = time.monotonic()
        preemptions = retries = 0
        target = next(targets)
        while True:
            outcome.attempts += 1
            outcome.replica = target.key
            preemptible = gateway.admission.preemptible(request.info, preemptions)
            try:
                return await gateway.forwarder.attempt(http, request, target, headers, outcome,
                                                       request.rank if preemptible else None)
            except Retryable as exc:
                outcome.error = exc.cause
                target = next(targets, None) if retries < gateway.config.retries else None
                if target is None:
                    raise GatewayError(503, "no replica could be reached; retry shortly",
                                       headers={"Retry-After": "1"}) from None
                retries += 1
                gateway.metrics.retries.labels(exc.cause).inc()
                log.info("retrying id=%s replica=%s cause=%s", outcome.request_id, outcome.replica, exc.cause)
            except Preempted:
                preemptions += 1
                gateway.metrics.preempted.labels(request.info.priority_class).inc()
                log.info("preempted id=%s replica=%s class=%s times=%d", outcome.request_id, outcome.replica,
                         request.info.priority_class, preemptions)
                gateway.admission.release(request.model)  # its seat goes to the request that preempted it
                standing = await gateway.admission.admit(request.info, request.rank, preemptions)
                decision = self.decide(request, standing=standing)
                targets = iter((decision.endpoint, *decision.fallbacks))
                outcome.follow(decision)
                target = next(targets)

    def refuse(self, error: GatewayError, outcome: Outcome) -> web.Response:
        """The OpenAI-style answer to a request the gateway will not (or could not) serve."""
        outcome.status = error.status
        self.gateway.metrics.rejected.labels(str(error.status), error.param or "-").inc()
        response = error_response(error)
        response.headers["x-request-id"] = outcome.request_id
        return response

    def record(self, path: str, request: InferenceRequest | None, outcome: Outcome) -> None:
        """Record the request's metrics and write its one log line."""
        metrics = self.gateway.metrics
        model = request.model if request is not None else "-"
        duration = time.monotonic() - outcome.arrived
        # Only models some replica serves become label values: clients must not be able to mint series.
        model_label = model if self.gateway.serves(model) else "other"
        metrics.requests.labels(path, model_label, str(outcome.status), outcome.replica).inc()
        metrics.duration.labels(path, model_label).observe(duration)
        if outcome.ttfb is not None:
            metrics.ttfb.labels(path, model_label).observe(outcome.ttfb)
        log.info("request id=%s path=%s model=%s class=%s replica=%s reason=%s matched=%.2f status=%s attempts=%d "
                 "wait_ms=%s ttfb_ms=%s duration_ms=%.1f%s%s", outcome.request_id, path, model,
                 request.info.priority_class if request is not None else "-", outcome.replica, outcome.reason,
                 outcome.matched, outcome.status, outcome.attempts, _ms(outcome.sent, outcome.arrived),
                 "-" if outcome.ttfb is None else f"{outcome.ttfb * 1000:.1f}", duration * 1000,
                 f" moved_by={outcome.moved_by}" if outcome.moved_by else "",
                 f" error={outcome.error}" if outcome.error else "")


def _ms(end: float | None, start: float) -> str:
    return "-" if end is None else f"{(end - start) * 1000:.1f}"


async def _body(http: web.Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes; 413 beyond."""
    if http.content_length is not None and http.content_length > limit:
        raise GatewayError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        return await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(413, f"request body exceeds the limit of {limit} bytes") from None
    except (RequestPayloadError, HttpProcessingError):
        raise GatewayError(400, "the request body is malformed") from None
