"""The endpoint picker over real gRPC: kvgate's gateway answering ext_proc streams as Envoy opens them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.policies.token_rate import MIN_REQUESTS
from kvgate.router.cli import build_parser, cli_settings
from kvgate.router.config import ConfigError, build_config, from_sources
from kvgate.router.picker import DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE
from kvgate.simulator import SimFleet, SimOptions
from tests.harness import RunningGateway, running_gateway, wait_until
from tests.test_auth import ALICE_SECRET, WRONG_SECRET, standard_keys
from tests.test_token_rate import (learned_as_the_engine_counted, scraped_metrics, tokenizing_sim,
                                   varied_chats)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DUPLEX = ext_proc.ProtocolConfiguration(request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED)
BUFFERED = ext_proc.ProtocolConfiguration(request_body_mode=ProcessingMode.BUFFERED)


def chat(content: str, **extra) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                         **extra})


def headers_message(headers: dict[str, str], mode: ext_proc.ProtocolConfiguration = DUPLEX,
                    metadata: dict | None = None, end_of_stream: bool = False) -> ext_proc.ProcessingRequest:
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in
              {":method": "POST", ":path": "/v1/chat/completions", **headers}.items()]
    context = Metadata()
    for namespace, fields in (metadata or {}).items():
        context.filter_metadata[namespace].update(fields)
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream),
        protocol_config=mode, metadata_context=context)


def body_messages(body: bytes, chunk: int = 7) -> list[ext_proc.ProcessingRequest]:
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)]
    return [ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1))
            for i, piece in enumerate(pieces)]


def served_message(address: str) -> ext_proc.ProcessingRequest:
    context = Metadata()
    context.filter_metadata[LB_NAMESPACE].update({SERVED: address})
    values = [HeaderValue(key=":status", raw_value=b"200")]
    return ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(headers=HeaderMap(headers=values)),
                                      metadata_context=context)


class Exchange:
    """One ext_proc stream driven like Envoy drives it: messages in, answers out, ended by the client."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, *messages: ext_proc.ProcessingRequest, answers: int = 0) -> list[ext_proc.ProcessingResponse]:
        for message in messages:
            await self.call.write(message)
        return [await asyncio.wait_for(self.call.read(), 5) for _ in range(answers)]

    async def end(self) -> None:
        await self.call.done_writing()
        assert await asyncio.wait_for(self.call.read(), 5) == grpc.aio.EOF


def destination(answer: ext_proc.ProcessingResponse) -> tuple[str, str]:
    """(header value, envoy.lb metadata value) of a routing answer."""
    response = getattr(answer, answer.WhichOneof("response")).response
    [option] = response.header_mutation.set_headers
    assert option.header.key == DESTINATION and response.clear_route_cache
    return option.header.raw_value.decode(), answer.dynamic_metadata[LB_NAMESPACE][DESTINATION]


def in_flight(gw: RunningGateway) -> int:
    return sum(state.in_flight for state in gw.gateway.fleet.snapshot().endpoints)


@contextlib.asynccontextmanager
async def picker(replicas: int = 3, sim: SimOptions = SimOptions(speed=50.0),
                 **settings) -> AsyncIterator[tuple[RunningGateway, SimFleet, grpc.aio.Channel]]:
    fleet = await SimFleet.start([0] * replicas, sim)
    try:
        async with running_gateway(endpoints=fleet.urls, picker_listen="127.0.0.1:0", **settings) as gw:
            await wait_until(lambda: gw.gateway.ready()[0] and gw.gateway.models_known(), timeout=10)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.server.picker.port}") as channel:
                yield gw, fleet, channel
    finally:
        await fleet.stop()


def addresses(fleet: SimFleet) -> list[str]:
    return [url.removeprefix("http://") for url in fleet.urls]


async def test_duplex_stream_gets_the_endpoint_in_header_and_metadata_then_its_body_back() -> None:
    async with picker(picker_fallbacks=2) as (gw, fleet, channel):
        exchange = Exchange(ext_proc_grpc.ExternalProcessorStub(channel))
        body = chat("hello " * 40)
        assert await exchange.send(headers_message({"x-request-id": "r1"})) == []
        headers_answer, body_answer = await exchange.send(*body_messages(body), answers=2)
        header, metadata = destination(headers_answer)
        streamed = body_answer.request_body.response.body_mutation.streamed_response
        assert streamed.body == body and streamed.end_of_stream
        assert header == metadata and len(header.split(",")) == 3
        assert set(header.split(",")) == set(addresses(fleet))  # the chosen endpoint, then two fallbacks
        assert in_flight(gw) == 1
        [response_answer] = await exchange.send(served_message(header.split(",")[1]), answers=1)
        assert response_answer.WhichOneof("response") == "response_headers"
        [moved] = [s for s in gw.gateway.fleet.snapshot().endpoints if s.in_flight]
        assert moved.endpoint.address == header.split(",")[1]  # the count follows the endpoint that served
        await exchange.end()
        await wait_until(lambda: in_flight(gw) == 0)
        labels = {"route": "/v1/chat/completions", "model": MODEL, "status": "200", "replica": moved.key}
        assert gw.gateway.metrics.registry.get_sample_value("kvgate_requests_total", labels) == 1


async def test_buffered_mode_answers_headers_at_once_and_routes_in_the_body_answer() -> None:
    async with picker(replicas=1) as (gw, fleet, channel):
        exchange = Exchange(ext_proc_grpc.ExternalProcessorStub(channel))
        [headers_answer] = await exchange.send(headers_message({}, BUFFERED), answers=1)
        assert headers_answer.WhichOneof("response") == "request_headers"
        [body_answer] = await exchange.send(*body_messages(chat("hi"), chunk=10_000), answers=1)
        assert destination(body_answer) == (addresses(fleet)[0], addresses(fleet)[0])
        await exchange.end()


async def test_the_same_conversation_goes_back_to_the_same_endpoint() -> None:
    async with picker() as (_, _, channel):
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        chosen = []
        for turn in range(4):
            exchange = Exchange(stub)
            await exchange.send(headers_message({}))
            prompt = "You are a careful assistant. " * 30 + "turn " * turn
            [answer, _] = await exchange.send(*body_messages(chat(prompt), chunk=4096), answers=2)
            chosen.append(destination(answer)[0])
            await exchange.end()
    assert len(set(chosen)) == 1


async def test_subset_hint_limits_the_choice_and_an_empty_one_gets_503() -> None:
    async with picker() as (_, fleet, channel):
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        only = addresses(fleet)[2]
        for n in range(3):
            exchange = Exchange(stub)
            await exchange.send(headers_message({}, metadata={SUBSET_NAMESPACE: {SUBSET: [only]}}))
            [answer, _] = await exchange.send(*body_messages(chat(f"question {n}")), answers=2)
            assert destination(answer) == (only, only)
            await exchange.end()
        exchange = Exchange(stub)
        await exchange.send(headers_message({}, metadata={SUBSET_NAMESPACE: {SUBSET: ["10.9.9.9:1"]}}))
        [refused] = await exchange.send(*body_messages(chat("nowhere")), answers=1)
    assert refused.immediate_response.status.code == 503
    assert orjson.loads(refused.immediate_response.body)["error"]["code"] == 503


@pytest.mark.parametrize(("headers", "body", "status"), [
    ({}, b"{not json", 400),
    ({"x-priority": "urgent"}, chat("hi"), 400),
    ({}, orjson.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}), 404),
    ({":path": "/v1/models", ":method": "GET"}, None, 404),
    ({}, chat("x" * 2000), 413),
])
async def test_bad_requests_get_immediate_openai_errors(headers, body, status) -> None:
    async with picker(replicas=1, max_body_bytes=1000) as (gw, _, channel):
        exchange = Exchange(ext_proc_grpc.ExternalProcessorStub(channel))
        if body is None:
            [answer] = await exchange.send(headers_message(headers, end_of_stream=True), answers=1)
        else:
            await exchange.send(headers_message(headers))
            [answer] = await exchange.send(*body_messages(body, chunk=4096), answers=1)
        immediate = answer.immediate_response
        error = orjson.loads(immediate.body)["error"]
        assert immediate.status.code == status and error["code"] == status and error["message"]
        await exchange.call.done_writing()
        assert in_flight(gw) == 0


async def test_a_stream_that_starts_without_headers_is_refused_not_crashed() -> None:
    async with picker(replicas=1) as (gw, _, channel):
        exchange = Exchange(ext_proc_grpc.ExternalProcessorStub(channel))
        [answer] = await exchange.send(body_messages(chat("orphan"))[0], answers=1)
        assert answer.immediate_response.status.code == 400
        await exchange.end()
        assert in_flight(gw) == 0


async def test_a_shed_request_gets_429_and_a_cancelled_stream_gives_its_seat_back() -> None:
    settings = {"saturation": {"in_flight": 1}, "admission": {"max_wait": {"batch": 0.2}}}
    async with picker(replicas=1, **settings) as (gw, _, channel):
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        holder = Exchange(stub)
        await holder.send(headers_message({}))
        await holder.send(*body_messages(chat("long one")), answers=2)
        shed = Exchange(stub)
        await shed.send(headers_message({"x-priority": "batch"}))
        [refused] = await shed.send(*body_messages(chat("later")), answers=1)
        assert refused.immediate_response.status.code == 429
        assert any(h.header.key == "retry-after" for h in refused.immediate_response.headers.set_headers)
        holder.call.cancel()  # the client left: Envoy resets the stream
        await wait_until(lambda: in_flight(gw) == 0)
        again = Exchange(stub)
        await again.send(headers_message({"x-priority": "batch"}))
        [routed, _] = await again.send(*body_messages(chat("now")), answers=2)
        assert destination(routed)[0]
        await again.end()


def response_body_message(end_of_stream: bool) -> ext_proc.ProcessingRequest:
    chunk = ext_proc.HttpBody(body=b"data: {}\n\n", end_of_stream=end_of_stream)
    return ext_proc.ProcessingRequest(response_body=chunk)


async def test_with_response_bodies_sent_only_prompts_whose_answer_ended_count_toward_the_rate(tiny_model_dir) -> None:
    """A data plane that streams response bodies to the picker shows which answers ended: a 200 whose body was cut
    off (a client's abort, which vLLM does not count) must not count, however long its prompt."""
    async with picker(replicas=1, sim=tokenizing_sim(tiny_model_dir), scrape_interval=0.05,
                      scrape_timeout=0.04) as (gw, fleet, channel), aiohttp.ClientSession() as session:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        await wait_until(lambda: scraped_metrics(gw.gateway).finished_requests == 0)  # counted from the start
        bodies = varied_chats(MODEL, MIN_REQUESTS + 8)
        for i, body in enumerate(bodies):
            if i % 8 == 0:  # Envoy's exchange for a long prompt whose client left mid-answer
                left = Exchange(stub)
                await left.send(headers_message({}))
                await left.send(*body_messages(chat("Tell me everything about every replica. " * 40)), answers=2)
                await left.send(served_message(addresses(fleet)[0]), response_body_message(False), answers=2)
                await left.end()
            exchange = Exchange(stub)  # the data plane's exchange, while it sends the request to the engine itself
            await exchange.send(headers_message({}))
            await exchange.send(*body_messages(orjson.dumps(body), chunk=10_000), answers=2)
            async with session.post(fleet.urls[0] + "/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
            await exchange.send(served_message(addresses(fleet)[0]), response_body_message(True), answers=2)
            await exchange.end()
        await learned_as_the_engine_counted(gw.gateway, session, fleet.urls[0], MODEL, bodies)


async def test_with_api_keys_the_picker_demands_one_limits_it_and_keeps_it_from_the_replica(tmp_path) -> None:
    keys = standard_keys(tmp_path, requests_per_minute=1)
    async with picker(replicas=1, api_keys_file=str(keys)) as (gw, _, channel):
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        answers = []
        for headers in ({}, {"authorization": f"Bearer {WRONG_SECRET}"}, {"authorization": f"Bearer {ALICE_SECRET}"},
                        {"authorization": f"Bearer {ALICE_SECRET}"}):
            exchange = Exchange(stub)
            await exchange.send(headers_message(headers))
            [answer, *_] = await exchange.send(*body_messages(chat("hi")), answers=1)
            answers.append(answer)
            exchange.call.cancel()
    statuses = [a.immediate_response.status.code if a.HasField("immediate_response") else 200 for a in answers]
    assert statuses == [401, 401, 200, 429]  # alice may send one request a minute
    assert list(answers[2].request_headers.response.header_mutation.remove_headers) == ["authorization"]
    assert gw.gateway.metrics.auth_failures.labels("missing")._value.get() == 1


def test_picker_and_pool_settings_come_from_file_env_and_flags_and_are_checked(tmp_path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("picker_listen: 0.0.0.0:9002\ndiscovery: inferencepool\npool: llm\npriorities:\n"
                    "  bands: {interactive: 5}\n")
    config = from_sources({"config": str(path)}, {"KVGATE_PICKER_FALLBACKS": "2"})
    assert (config.picker_address, config.pool, config.picker_fallbacks) == (("0.0.0.0", 9002), "llm", 2)
    assert config.priorities.bands == {"interactive": 5}
    flags = cli_settings(build_parser().parse_args(["serve", "--config", str(path), "--picker-listen", "[::1]:0"]))
    assert from_sources(flags, {}).picker_address == ("::1", 0)
    for bad, setting in (({"pool": None}, "pool"), ({"picker_listen": "9002"}, "picker_listen"),
                         ({"picker_fallbacks": -1}, "picker_fallbacks"),
                         ({"priorities": {"bands": {"urgent": 1}}}, "priorities.bands")):
        with pytest.raises(ConfigError, match=setting):
            build_config({"discovery": "inferencepool", "pool": "llm", **bad})


async def test_health_services_follow_readiness_and_the_drain() -> None:
    async with picker(replicas=1) as (gw, _, channel):
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("liveness", "readiness", EXT_PROC_SERVICE):
            assert await status(service) == serving
        gw.gateway.draining = True
        await asyncio.sleep(0.7)  # the picker looks at readiness twice a second
        assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status(EXT_PROC_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("liveness") == serving
        gw.gateway.draining = False
