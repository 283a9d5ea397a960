"""Streaming through the gateway: unbuffered chunks, upstream abort on disconnect, mid-stream failures."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from tests.harness import running_gateway, scripted_replica, sse_event, wait_until

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def test_chunk_reaches_client_before_replica_sends_the_next() -> None:
    client_got_first = asyncio.Event()
    replica_log: list[str] = []

    async def lockstep(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse_event(b'{"n": 1}'))
        try:
            # The second chunk is sent only once the client has the first: a buffering proxy deadlocks here.
            await asyncio.wait_for(client_got_first.wait(), 5)
            replica_log.append("client had chunk 1")
        except asyncio.TimeoutError:
            replica_log.append("timed out waiting for the client")
        await response.write(sse_event(b'{"n": 2}') + sse_event(b"[DONE]"))
        return response

    async with scripted_replica([("POST", "/v1/chat/completions", lockstep)]) as url, \
            running_gateway(endpoints=[url]) as gw, aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.headers["X-Accel-Buffering"] == "no"
            assert resp.headers["Cache-Control"] == "no-cache"
            first = await resp.content.readuntil(b"\n\n")
            assert first == b'data: {"n": 1}\n\n'
            client_got_first.set()
            rest = await resp.content.read()
    assert replica_log == ["client had chunk 1"]
    assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'


async def test_client_disconnect_aborts_the_upstream_request() -> None:
    replica_saw_abort = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for n in range(400):  # bounded: 20 s at most
                await response.write(sse_event(b'{"n": %d}' % n))
                await asyncio.sleep(0.05)
        except (asyncio.CancelledError, ConnectionResetError):
            replica_saw_abort.set()
            raise
        return response

    async with scripted_replica([("POST", "/v1/chat/completions", endless)]) as url, \
            running_gateway(endpoints=[url]) as gw:
        async with aiohttp.ClientSession() as client:
            resp = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
            await resp.content.readuntil(b"\n\n")
            resp.close()  # the client goes away mid-stream
        await asyncio.wait_for(replica_saw_abort.wait(), 3)
        await wait_until(lambda: gw.gateway.fleet.in_flight(url) == 0)


async def test_replica_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def dies(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse_event(b'{"n": 1}'))
        request.transport.abort()  # the replica process vanishes
        return response

    async with scripted_replica([("POST", "/v1/chat/completions", dies)]) as url, \
            running_gateway(endpoints=[url]) as gw, aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            body = await resp.content.read()
        # The gateway stays up for the next request.
        async with client.get(gw.url + "/healthz") as health:
            assert health.status == 200
    events = [e for e in body.split(b"\n\n") if e]
    assert events[0] == b'data: {"n": 1}'
    error = orjson.loads(events[1].removeprefix(b"data: "))
    assert error["error"]["code"] == 502 and "mid-stream" in error["error"]["message"]
    assert events[-1] == b"data: [DONE]"


async def test_stalled_replica_hits_the_idle_timeout_with_an_error_event() -> None:
    release = asyncio.Event()

    async def stalls(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse_event(b'{"n": 1}'))
        await asyncio.wait_for(release.wait(), 10)
        return response

    async with scripted_replica([("POST", "/v1/chat/completions", stalls)]) as url, \
            running_gateway(endpoints=[url], idle_timeout=0.3) as gw, aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
            body = await asyncio.wait_for(resp.content.read(), 5)
        release.set()
    assert b"stopped answering" in body and body.endswith(b"data: [DONE]\n\n")


async def test_non_streaming_error_body_and_status_pass_through_unchanged() -> None:
    upstream_error = b'{"error":{"message":"bad","type":"BadRequestError","param":"max_tokens","code":400}}'

    async def rejects(request: web.Request) -> web.Response:
        return web.Response(status=400, body=upstream_error, content_type="application/json")

    async with scripted_replica([("POST", "/v1/completions", rejects)]) as url, \
            running_gateway(endpoints=[url]) as gw, aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 400
            assert await resp.read() == upstream_error
