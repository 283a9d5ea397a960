"""The gateway's HTTP surface over real sockets: bad input, header hygiene, models, health, the openai SDK."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from kvgate.simulator import SimFleet, SimOptions
from tests.harness import closed_port, running_gateway, scripted_replica, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FAST = SimOptions(speed=50.0)


@pytest.fixture
async def sim() -> SimFleet:
    fleet = await SimFleet.start([0, 0], FAST)
    yield fleet
    await fleet.stop()


def total_requests(fleet: SimFleet) -> int:
    return sum(replica.stats()["requests"] for replica in fleet.replicas)


def assert_openai_error(body: dict, status: int) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]


BAD_BODIES = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    (b'{"model": 7, "messages": []}', 400, "model"),
    (b'{"model": "m", "messages": "hello"}', 400, "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
    (b'\xff\xfe{"model": "m"}', 400, None),
    (b"[" * 5000 + b"]" * 5000, 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_BODIES)
async def test_bad_body_is_answered_by_the_gateway_and_never_forwarded(sim, body, status, param) -> None:
    async with running_gateway(endpoints=sim.urls) as gw, aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", data=body,
                               headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status
            error = await resp.json()
        assert_openai_error(error, status)
        assert error["error"]["param"] == param
        async with client.get(gw.url + "/healthz") as health:
            assert health.status == 200
    assert total_requests(sim) == 0


async def test_body_over_the_limit_gets_413(sim) -> None:
    async with running_gateway(endpoints=sim.urls, max_body_bytes=1000) as gw, aiohttp.ClientSession() as client:
        big = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]})
        async with client.post(gw.url + "/v1/chat/completions", data=big) as resp:
            assert resp.status == 413
            assert_openai_error(await resp.json(), 413)
    assert total_requests(sim) == 0


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nope", 404), ("POST", "/admin", 404), ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models", 405),
])
async def test_unknown_paths_and_methods_get_openai_errors(sim, method, path, status) -> None:
    async with running_gateway(endpoints=sim.urls) as gw, aiohttp.ClientSession() as client:
        async with client.request(method, gw.url + path) as resp:
            assert resp.status == status
            assert_openai_error(await resp.json(), status)


async def test_unknown_model_gets_404_naming_it(sim) -> None:
    async with running_gateway(endpoints=sim.urls) as gw, aiohttp.ClientSession() as client:
        await wait_until(lambda: gw.gateway.fleet.snapshot().known_models() == {MODEL})
        body = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
        async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
    assert error["param"] == "model" and "no-such-model" in error["message"]
    assert total_requests(sim) == 0


async def test_no_reachable_replica_gets_503_with_retry_after() -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    async with running_gateway(endpoints=[dead]) as gw, aiohttp.ClientSession() as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert_openai_error(await resp.json(), 503)


async def test_connect_failure_is_retried_once_on_another_replica(sim) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    async with running_gateway(endpoints=[dead, sim.urls[0]], policy="round-robin") as gw, \
            aiohttp.ClientSession() as client:
        for n in range(6):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{n}"}], "max_tokens": 2}
            async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
    assert sim.replicas[0].stats()["requests"] == 6


async def test_vllm_shutdown_500_is_retried_elsewhere_but_other_500s_are_relayed(sim) -> None:
    """vLLM 0.32 fails new requests during its shutdown drain with this 500: the request never ran there."""
    seen = {"crashing": 0, "refusing": 0}

    async def crashing(request: web.Request) -> web.Response:
        seen["crashing"] += 1
        return web.json_response({"error": {"message": "cannot schedule new futures after shutdown",
                                            "type": "InternalServerError", "param": None, "code": 500}}, status=500)

    async def refusing(request: web.Request) -> web.Response:
        seen["refusing"] += 1
        return web.json_response({"error": {"message": "prompt too long", "type": "BadRequestError", "param": None,
                                            "code": 500}}, status=500)

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with scripted_replica([("POST", "/v1/chat/completions", crashing)]) as crash_url, \
            scripted_replica([("POST", "/v1/chat/completions", refusing)]) as refuse_url, \
            aiohttp.ClientSession() as client:
        async with running_gateway(endpoints=[crash_url, sim.urls[0]], policy="round-robin") as gw:
            for _ in range(4):
                async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
        async with running_gateway(endpoints=[refuse_url, sim.urls[0]], policy="round-robin") as gw:
            statuses = []
            for _ in range(4):
                async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    statuses.append(resp.status)
                    if resp.status == 500:
                        assert (await resp.json())["error"]["message"] == "prompt too long"
    assert seen["crashing"] >= 1 and sorted(statuses) == [200, 200, 500, 500] and seen["refusing"] == 2


async def test_hop_by_hop_headers_never_cross_and_request_id_propagates() -> None:
    seen: CIMultiDict[str] = CIMultiDict()

    async def echo(request: web.Request) -> web.Response:
        seen.clear()
        seen.extend(request.headers)
        return web.json_response({"ok": True}, headers={
            "Keep-Alive": "timeout=5", "Proxy-Authenticate": "Basic", "Trailer": "X-Checksum",
            "X-Upstream": "kept", "X-Private-Hop": "dropped", "Connection": "X-Private-Hop"})

    async with scripted_replica([("POST", "/v1/completions", echo)]) as url, \
            running_gateway(endpoints=[url]) as gw, aiohttp.ClientSession() as client:
        headers = {"Keep-Alive": "timeout=5", "TE": "trailers", "Proxy-Authorization": "Basic eA==",
                   "Trailer": "X-Checksum", "Upgrade": "websocket", "X-Custom": "kept", "X-Drop-Me": "x",
                   "Connection": "keep-alive, X-Drop-Me", "x-request-id": "req-123"}
        async with client.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                               headers=headers) as resp:
            assert resp.status == 200
            response_headers = resp.headers
        forwarded = seen.copy()
        async with client.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            generated = resp.headers["x-request-id"]
            upstream_generated = seen["x-request-id"]
    lowered = {k.lower() for k in forwarded}
    assert not lowered & {"keep-alive", "te", "proxy-authorization", "trailer", "upgrade", "x-drop-me"}
    assert forwarded["X-Custom"] == "kept" and forwarded["x-request-id"] == "req-123"
    assert response_headers["X-Upstream"] == "kept"
    assert not {k.lower() for k in response_headers} & {"keep-alive", "proxy-authenticate", "trailer",
                                                         "x-private-hop"}
    assert response_headers["x-request-id"] == "req-123"
    assert generated == upstream_generated and len(generated) >= 16


async def test_models_is_the_deduplicated_union_of_the_replicas() -> None:
    first = await SimFleet.start([0, 0], SimOptions(speed=50.0, models=("base-a",), lora_adapters=("tenant-x",)))
    second = await SimFleet.start([0], SimOptions(speed=50.0, models=("base-a", "base-b")))
    try:
        async with running_gateway(endpoints=first.urls + second.urls) as gw, aiohttp.ClientSession() as client:
            await wait_until(lambda: len(gw.gateway.fleet.snapshot().known_models()) == 3)
            async with client.get(gw.url + "/v1/models") as resp:
                listing = await resp.json()
    finally:
        await first.stop()
        await second.stop()
    ids = [card["id"] for card in listing["data"]]
    assert listing["object"] == "list"
    assert sorted(ids) == ["base-a", "base-b", "tenant-x"]
    adapter = next(card for card in listing["data"] if card["id"] == "tenant-x")
    assert adapter["parent"] == "base-a"


async def test_openai_sdk_streams_a_chat_completion_through_the_gateway(sim) -> None:
    async with running_gateway(endpoints=sim.urls) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello"}], stream=True, max_tokens=8,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text.strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


async def test_each_request_logs_where_it_went_and_why(sim, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.router.pipeline")
    system = "You are a careful assistant for the billing team. " * 20
    messages = [{"role": "system", "content": system}]
    async with running_gateway(endpoints=sim.urls) as gw, aiohttp.ClientSession() as client:
        for question in ("first question about an invoice " * 8, "second question"):  # one conversation, two turns
            messages.append({"role": "user", "content": question})
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={"model": MODEL, "messages": messages, "max_tokens": 4}) as resp:
                assert resp.status == 200, await resp.text()
                messages.append((await resp.json())["choices"][0]["message"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request id=")]
    assert len(lines) == 2
    assert "class=interactive" in lines[0] and "reason=cold matched=0.00 status=200" in lines[0]
    assert float(lines[0].split("wait_ms=")[1].split()[0]) >= 0.0  # time before it was sent: none was queued
    # the second turn goes where the first left the conversation, which holds most of its prompt
    replica = lines[0].split("replica=")[1].split()[0]
    assert f"replica={replica} reason=prefix_hit matched=" in lines[1]
    assert float(lines[1].split("matched=")[1].split()[0]) > 0.8


async def test_readiness_and_metrics_report_the_gateway_state(sim) -> None:
    async with running_gateway(endpoints=sim.urls) as gw, aiohttp.ClientSession() as client:
        async with client.get(gw.url + "/readyz") as resp:
            assert resp.status == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        async with client.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        async with client.get(gw.url + "/debug/fleet") as resp:
            fleet = await resp.json()
    assert 'kvgate_requests_total{model="%s",replica=' % MODEL in text
    assert "kvgate_time_to_first_byte_seconds_bucket" in text
    assert "kvgate_routing_decisions_total" in text
    assert sorted(e["url"] for e in fleet["endpoints"]) == sorted(sim.urls)


async def test_drain_finishes_in_flight_stream_while_readiness_fails() -> None:
    fleet = await SimFleet.start([0], SimOptions(speed=1.0))
    try:
        async with running_gateway(endpoints=fleet.urls, drain_delay=0.3) as gw, \
                aiohttp.ClientSession() as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
                    "stream": True}
            resp = await client.post(gw.url + "/v1/chat/completions", json=body)
            await resp.content.readuntil(b"\n\n")
            drain = asyncio.create_task(gw.server.drain())
            await wait_until(lambda: gw.gateway.draining)
            async with client.get(gw.url + "/readyz") as ready:
                assert ready.status == 503
            rest = await asyncio.wait_for(resp.content.read(), 10)
            await asyncio.wait_for(drain, 10)
    finally:
        await fleet.stop()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert rest.count(b"data: ") >= 40
