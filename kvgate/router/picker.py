"""The Gateway API Inference Extension endpoint picker: Envoy's ext_proc stream, answered by the gateway.

Each HTTP request Envoy proxies opens one `ExternalProcessor/Process` stream. kvgate reads the request's
headers and body, runs them through the same API keys and rate limits, classification, admission queue, policy
and fleet as its own proxy (RequestPipeline.read and .admitted), and answers with the chosen endpoint (then the fallbacks) in the header
`x-gateway-destination-endpoint` and in the `envoy.lb` dynamic metadata; or with an immediate 4xx/5xx. The
request holds its admission and its replica's in-flight count until Envoy ends the stream, which it does
when the HTTP request ends, a client cancellation included. The body is read in FULL_DUPLEX_STREAMED mode
(sent back unchanged once the headers are answered) or BUFFERED mode; the response is not read, only its
headers where Envoy sends them: the endpoint that served (`envoy.lb` metadata
`x-gateway-destination-endpoint-served`), and the status, by which an answered prompt counts toward the
replica's characters per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvgate.endpoints.types import EndpointState
from kvgate.policies.types import Decision
from kvgate.router.auth import CREDENTIAL_HEADERS, require_key
from kvgate.router.errors import GatewayError, error_body
from kvgate.router.gateway import Gateway
from kvgate.router.headers import request_id as make_request_id
from kvgate.router.metrics import NO_REPLICA
from kvgate.router.pipeline import RequestPipeline
from kvgate.router.requests import ROUTE_KINDS, InferenceRequest

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE)
_HEALTH_REFRESH_S = 0.5
_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass
class _Request:
    """What one stream learned about its HTTP request."""

    headers: dict[str, str]
    duplex: bool  # FULL_DUPLEX_STREAMED: the headers are answered after the body, which is sent back
    subset: frozenset[str] | None  # the data plane's subset hint: pick only from these `host:port` addresses
    body: bytearray
    request_id: str
    arrived: float


class PickerStream:
    """One ext_proc stream: answers each message, and holds the request's admission and replica until closed."""

    def __init__(self, pipeline: RequestPipeline) -> None:
        self._pipeline = pipeline
        self._gateway = pipeline.gateway
        self._held = contextlib.AsyncExitStack()
        self._request: _Request | None = None
        self._decision: Decision | None = None
        self._parsed: InferenceRequest | None = None
        self._replica: str | None = None  # the endpoint whose in-flight count this request holds
        self._status = "-"
        self._body_seen = False  # the data plane sends the picker response bodies
        self._answered = False  # the response's body ended (its last chunk or its trailers came; an abort sends none)

    async def answer(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        """The responses to one message from Envoy, in order (none while a duplex body is still arriving)."""
        kind = message.WhichOneof("request")
        self._gateway.metrics.picker_messages.labels(kind).inc()
        if kind == "request_headers":
            return await self._request_headers(message)
        if self._request is None:
            return [self._refusal(GatewayError(400, f"ext_proc stream sent {kind} before the request headers"))]
        if kind == "request_body":
            return await self._request_body(message)
        if kind == "request_trailers":
            return await self._request_trailers(message)
        if kind == "response_headers":
            self._response_headers(message)
            return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]
        if kind == "response_body":
            self._body_seen = True
            self._answered |= message.response_body.end_of_stream
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
        self._answered = True
        return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]

    async def close(self) -> None:
        """The HTTP request is over: give back its admission and its replica's in-flight count, and count the prompt's
        characters for the replica's characters per token when its answer came whole."""
        replica = self._replica or NO_REPLICA  # the release below forgets it
        await self._held.aclose()
        if self._request is None:
            return
        # A 200 whose body ended; where the data plane sends no response bodies, a 200 (Envoy ends the stream
        # alike for a finished answer and a client's abort, which vLLM leaves out: see docs/routing.md).
        if self._status == "200" and (self._answered or not self._body_seen) and replica != NO_REPLICA \
                and self._parsed is not None:
            self._gateway.fleet.answered(replica, self._parsed.info.prompt_chars)
        model = self._parsed.info.model if self._parsed else "-"
        path = self._request.headers.get(":path", "").partition("?")[0]
        # Only models some replica serves, and only routed paths, become label values.
        self._gateway.metrics.requests.labels(path if path in ROUTE_KINDS else "other",
                                              model if self._gateway.serves(model) else "other",
                                              self._status, replica).inc()
        reason = self._decision.reason if self._decision else "-"
        moved_by = f" moved_by={self._decision.moved_by}" if self._decision and self._decision.moved_by else ""
        log.info("picked id=%s model=%s replica=%s reason=%s status=%s duration_ms=%.1f%s", self._request.request_id,
                 model, replica, reason, self._status, (time.monotonic() - self._request.arrived) * 1000, moved_by)

    async def _request_headers(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        headers = {h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
                   for h in message.request_headers.headers.headers}
        duplex = message.protocol_config.request_body_mode == _DUPLEX
        subset = _subset(message.metadata_context.filter_metadata)
        self._request = _Request(headers, duplex, subset, bytearray(), make_request_id(headers), time.monotonic())
        path = headers.get(":path", "").partition("?")[0]
        if path not in ROUTE_KINDS or headers.get(":method") != "POST":
            return [self._refusal(GatewayError(404, f"no route for {headers.get(':method')} {path}"))]
        if message.request_headers.end_of_stream:
            return await self._decide(message, headers_answered=False)
        if duplex:
            return []
        return [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())]

    async def _request_body(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        request = self._request
        assert request is not None
        request.body += message.request_body.body
        limit = self._gateway.config.max_body_bytes
        if len(request.body) > limit:
            return [self._refusal(GatewayError(413, f"request body exceeds the limit of {limit} bytes"))]
        if not message.request_body.end_of_stream:
            # BUFFERED sends the body whole; a duplex body is answered once complete
            return [] if request.duplex else [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())]
        return await self._decide(message, headers_answered=not request.duplex)

    async def _request_trailers(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        answers = []
        assert self._request is not None
        if self._decision is None and self._request.duplex:
            answers = await self._decide(message, headers_answered=False, body_ends=False)
        return [*answers, ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]

    async def _decide(self, message: ext_proc.ProcessingRequest, headers_answered: bool,
                      body_ends: bool = True) -> list[ext_proc.ProcessingResponse]:
        """Parse, admit and pick; the answer that sends the request to the chosen endpoints, or a refusal."""
        request = self._request
        assert request is not None
        gateway = self._gateway
        try:
            key = None if gateway.keys is None else require_key(
                gateway.keys, request.headers.get("authorization"), gateway.metrics.auth_failures,
                f"picker id={request.request_id}")
            self._parsed = await self._pipeline.read(request.headers[":path"].partition("?")[0], request.headers,
                                                     bytes(request.body), key)
            decision = await self._held.enter_async_context(self._pipeline.admitted(self._parsed, request.subset))
        except GatewayError as error:
            gateway.metrics.rejected.labels(str(error.status), error.param or "-").inc()
            return [self._refusal(error)]
        self._decision = decision
        self._hold(decision.endpoint)
        targets = [decision.endpoint, *decision.fallbacks[:gateway.config.picker_fallbacks]]
        value = ",".join(state.endpoint.address for state in targets)
        routed = ext_proc.CommonResponse(header_mutation=ext_proc.HeaderMutation(
            set_headers=[HeaderValueOption(header=HeaderValue(key=DESTINATION, raw_value=value.encode()),
                                           append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)],
            # kvgate's own API keys never reach a replica, as through its proxy
            remove_headers=sorted(CREDENTIAL_HEADERS) if gateway.keys is not None else []), clear_route_cache=True)
        metadata = Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: value}})
        if headers_answered:  # BUFFERED: the body's answer carries the header
            return [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=routed),
                                                dynamic_metadata=metadata)]
        answers = [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=routed),
                                               dynamic_metadata=metadata)]
        if request.duplex and message.WhichOneof("request") != "request_headers":
            body = ext_proc.StreamedBodyResponse(body=bytes(request.body), end_of_stream=body_ends)
            answers.append(ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(
                response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=body)))))
        return answers

    def _response_headers(self, message: ext_proc.ProcessingRequest) -> None:
        """Note the response status and, when Envoy reports it, move the in-flight count to the endpoint that served."""
        for header in message.response_headers.headers.headers:
            if header.key == ":status":
                self._status = header.raw_value.decode("latin-1") if header.raw_value else header.value
        served = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
        address = served.fields[SERVED].string_value if served is not None and SERVED in served.fields else ""
        if not address or self._decision is None or self._decision.endpoint.endpoint.address == address:
            return
        state = next((s for s in (self._decision.endpoint, *self._decision.fallbacks)
                      if s.endpoint.address == address), None)
        if state is not None:
            self._hold(state)

    def _hold(self, state: EndpointState) -> None:
        """Count this request in flight on `state` (instead of on the endpoint it was counted on before)."""
        gateway = self._gateway
        assert self._parsed is not None
        if self._replica is not None:
            self._release()
        key = self._replica = state.key
        gateway.fleet.acquire(key, self._parsed.info)
        gateway.metrics.in_flight.labels(key).inc()
        gateway.routed(self._parsed.info, state)
        self._held.callback(self._release_once, key)

    def _release_once(self, key: str) -> None:
        if self._replica == key:
            self._release()

    def _release(self) -> None:
        gateway = self._gateway
        assert self._replica is not None and self._parsed is not None
        gateway.fleet.release(self._replica, self._parsed.info)
        gateway.metrics.in_flight.labels(self._replica).dec()
        self._replica = None

    def _refusal(self, error: GatewayError) -> ext_proc.ProcessingResponse:
        """An immediate OpenAI-style error answer that Envoy sends to the client instead of proxying."""
        self._status = str(error.status)
        headers = {"content-type": "application/json", **{k.lower(): v for k, v in (error.headers or {}).items()}}
        if self._request is not None:
            headers["x-request-id"] = self._request.request_id
        mutation = ext_proc.HeaderMutation(set_headers=[
            HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode())) for k, v in headers.items()])
        return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
            status=HttpStatus(code=error.status), headers=mutation,
            body=error_body(error.status, error.message, error.param), details=f"kvgate_{error.status}"))


def _subset(filter_metadata: Mapping[str, Struct]) -> frozenset[str] | None:
    """The `host:port` addresses of the request's subset hint, None when there is none."""
    hint = filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.WhichOneof("kind") == "list_value":
        return frozenset(v.string_value.strip() for v in value.list_value.values)
    return frozenset(filter(None, (part.strip() for part in value.string_value.split(","))))


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """The ext_proc service: one PickerStream per stream."""

    def __init__(self, gateway: Gateway) -> None:
        self._pipeline = RequestPipeline(gateway)

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],  # noqa: N802 (gRPC name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ext_proc.ProcessingResponse]:
        """Answer Envoy's messages for one HTTP request until it ends the stream."""
        stream = PickerStream(self._pipeline)
        try:
            async for message in request_iterator:
                for response in await stream.answer(message):
                    yield response
        finally:
            await stream.close()


class PickerServer:
    """The picker's gRPC server: ext_proc and the health services, beside the gateway's HTTP listeners."""

    def __init__(self, gateway: Gateway, host: str, port: int) -> None:
        self._gateway = gateway
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._health_task: asyncio.Task | None = None
        self.port = 0  # the bound port, once started

    async def start(self) -> None:
        """Listen and serve; readiness follows the gateway's."""
        server = self._server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self._gateway), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = server.add_insecure_port(self._address)
        await server.start()
        await self._health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._refresh_health()
        self._health_task = asyncio.create_task(self._follow_readiness(), name="picker-health")
        log.info("endpoint picker listening address=%s port=%d", self._address, self.port)

    async def stop(self, grace: float) -> None:
        """Stop taking streams; those open get `grace` seconds to end."""
        if self._health_task is not None:
            self._health_task.cancel()
        if self._server is not None:
            await self._server.stop(grace)

    async def _follow_readiness(self) -> None:
        while True:
            await asyncio.sleep(_HEALTH_REFRESH_S)
            await self._refresh_health()

    async def _refresh_health(self) -> None:
        ready, _ = self._gateway.ready()
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES[1:]:
            await self._health.set(service, status)
