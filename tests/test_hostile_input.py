"""Hostile clients over raw sockets: each bad request gets its exact answer, reaches no replica, and the
gateway keeps serving; slow and idle clients are cut off; connections past the limit get a 503."""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from kvgate.router.requests import ROUTE_KINDS
from tests.harness import RunningGateway, running_gateway, wait_until
from tests.raw_http import Address, exchange, parse_responses, read_until_closed, request
from tests.recording_replica import MODEL, RecordingReplica, recording_replica

# Tiny timeouts so the slow-client tests take a second, not thirty.
TIGHT = {"header_timeout": 0.5, "body_timeout": 0.5, "keepalive_timeout": 1.0}
GOOD = orjson.dumps({"model": MODEL, "prompt": "hello"})
SLACK_S = 1.5  # how late past its timeout a cut-off may come on a loaded test machine


@pytest.fixture(autouse=True)
def no_error_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Hostile input is expected: it must never be logged as an error or with a traceback."""
    caplog.set_level(logging.INFO)
    yield
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors


@pytest.fixture
async def replica() -> AsyncIterator[RecordingReplica]:
    async with recording_replica() as started:
        yield started


@pytest.fixture
async def gateway(replica: RecordingReplica) -> AsyncIterator[RunningGateway]:
    async with running_gateway(endpoints=[replica.url], **TIGHT) as gw:
        yield gw


def address(gw: RunningGateway) -> Address:
    return gw.server.addresses[0]


async def assert_still_serves(gw: RunningGateway, replica: RecordingReplica) -> None:
    """A well-formed request after the hostile one goes through, and is the only thing the replica got."""
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/completions", data=GOOD,
                               headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == "ok"
    assert [(r.method, r.path_qs, r.body) for r in replica.received] == [("POST", "/v1/completions", GOOD)]
    assert "X-Injected" not in replica.received[0].headers


async def refused(gw: RunningGateway, *pieces: bytes, pause: float = 0.0) -> list[Any]:
    """Send raw pieces; the gateway must answer and close; returns the parsed responses."""
    return parse_responses(await exchange(address(gw), *pieces, pause=pause))


def deeply_nested(depth: int) -> bytes:
    return b'{"model":"%s","messages":[{"role":"user","content":%s%s}]}' % (MODEL.encode(), b"[" * depth,
                                                                            b"]" * depth)


# (path, body, status, param): bodies the JSON layer must refuse; none duplicates test_gateway_http's list.
BAD_BODIES = [
    ("/v1/chat/completions", deeply_nested(3000), 400, None),
    ("/v1/completions", b'{"model":"m","prompt":5}', 400, "prompt"),
    ("/v1/completions", b'{"model":"m","prompt":null}', 400, "prompt"),
    ("/v1/chat/completions", b'{"model":{"$ne":""},"messages":[{"role":"user","content":"x"}]}', 400, "model"),
    ("/v1/chat/completions", b'{"model":"m","messages":{"role":"user","content":"x"}}', 400, "messages"),
    ("/v1/chat/completions", b'{"model":"m","messages":[]}', 400, "messages"),
    ("/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":1}', 400,
     "stream"),
    ("/v1/embeddings", b'{"model":"m","input":{"text":"x"}}', 400, "input"),
    ("/v1/completions", b'{"model":"m\xc3\x28","prompt":"x"}', 400, None),  # invalid UTF-8 inside a string
    ("/v1/completions", b'{"model":"\\ud800","prompt":"x"}', 400, None),  # a lone surrogate escape
    ("/v1/completions", b'{"model":"m\x00","prompt":"x"}', 400, None),  # a raw control character
    ("/v1/completions", b"null", 400, None),
    ("/v1/completions", b"", 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_BODIES)
async def test_bad_json_bodies_are_refused_before_any_replica(gateway, replica, path, body, status, param) -> None:
    [response] = await refused(gateway, request("POST", path, body))
    assert response.openai_error(status)["param"] == param
    await assert_still_serves(gateway, replica)


CHUNKED = b"Transfer-Encoding: chunked\r\n"
POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gateway.test\r\n"

# Framing a front proxy and kvgate could read differently (request smuggling) must be refused outright.
BAD_FRAMING = {
    "content-length then transfer-encoding": [POST_HEAD + b"Content-Length: 5\r\n" + CHUNKED + b"\r\n0\r\n\r\n"],
    "transfer-encoding then content-length": [POST_HEAD + CHUNKED + b"Content-Length: 5\r\n\r\n0\r\n\r\n"],
    "two different content-lengths": [POST_HEAD + b"Content-Length: 2\r\nContent-Length: 27\r\n\r\n" + GOOD],
    "two equal content-lengths": [POST_HEAD + b"Content-Length: 27\r\nContent-Length: 27\r\n\r\n" + GOOD],
    "signed content-length": [POST_HEAD + b"Content-Length: +27\r\n\r\n" + GOOD],
    "chunked twice": [POST_HEAD + b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n"],
    "unknown transfer-coding": [POST_HEAD + b"Transfer-Encoding: gzip\r\n\r\n" + GOOD],
    "chunk size not hex": [POST_HEAD + CHUNKED + b"\r\nzz\r\n" + GOOD + b"\r\n0\r\n\r\n"],
    "negative chunk size": [POST_HEAD + CHUNKED + b"\r\n-1b\r\n" + GOOD + b"\r\n0\r\n\r\n"],
    "chunk size overflow": [POST_HEAD + CHUNKED + b"\r\nffffffffffffffffffff\r\n" + GOOD + b"\r\n0\r\n\r\n"],
    "chunk longer than its size": [POST_HEAD + CHUNKED + b"\r\n5\r\n" + GOOD + b"\r\n0\r\n\r\n"],
    # The handler is already waiting for the body when the bad chunk comes.
    "bad chunk after a good one": [POST_HEAD + CHUNKED + b"\r\n5\r\n" + GOOD[:5] + b"\r\n", b"zz\r\n"],
}


@pytest.mark.parametrize("pieces", BAD_FRAMING.values(), ids=BAD_FRAMING.keys())
async def test_ambiguous_or_broken_framing_gets_400_and_is_never_forwarded(gateway, replica, pieces) -> None:
    [response] = await refused(gateway, *pieces, pause=0.2)
    response.openai_error(400)
    await assert_still_serves(gateway, replica)


async def test_body_shorter_than_its_content_length_gets_408_when_the_client_stalls(gateway, replica) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    head = POST_HEAD + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    [response] = await refused(gateway, head + GOOD[:20])
    waited = loop.time() - started
    response.openai_error(408)
    assert TIGHT["body_timeout"] * 0.9 <= waited < TIGHT["body_timeout"] + SLACK_S
    await assert_still_serves(gateway, replica)


async def test_slow_but_steady_body_is_not_cut_off(gateway, replica) -> None:
    head = POST_HEAD + b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(GOOD)
    pieces = [head] + [GOOD[i:i + 4] for i in range(0, len(GOOD), 4)]
    # Eight pauses of 0.15 s: longer than body_timeout in total, never that long silent.
    [response] = parse_responses(await exchange(address(gateway), *pieces, pause=0.15))
    assert response.status == 200
    assert [r.body for r in replica.received] == [GOOD]


async def test_stalled_body_on_a_route_that_ignores_it_is_closed_quietly(gateway, replica) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    stalled = b"GET /healthz HTTP/1.1\r\nHost: gateway.test\r\nContent-Length: 50\r\n\r\nab"
    raw = await exchange(address(gateway), stalled)
    [response] = parse_responses(raw)
    assert response.status == 200
    assert loop.time() - started < TIGHT["body_timeout"] + SLACK_S
    await assert_still_serves(gateway, replica)


GARBAGE = b'xx{"smuggled": true}\r\n\r\n'


async def test_bytes_beyond_content_length_in_the_same_packet_are_refused_as_garbage(gateway, replica) -> None:
    keep_alive = request("POST", "/v1/completions", GOOD, close=False)
    responses = await refused(gateway, keep_alive + GARBAGE)
    # The parser may refuse the whole packet or answer the good request first; the garbage always gets a 400.
    responses[-1].openai_error(400)
    assert [r.status for r in responses[:-1]] in ([], [200])
    assert [r.body for r in replica.received] == [GOOD] * (len(responses) - 1)


async def test_bytes_beyond_content_length_sent_later_are_refused_as_garbage(gateway, replica) -> None:
    reader, writer = await asyncio.open_connection(*address(gateway))
    try:
        writer.write(request("POST", "/v1/completions", GOOD, close=False))
        await wait_until(lambda: len(replica.received) == 1)
        writer.write(GARBAGE)
        answered, refusal = parse_responses(await read_until_closed(reader, 5))
    finally:
        writer.close()
    assert answered.status == 200
    refusal.openai_error(400)
    assert [r.body for r in replica.received] == [GOOD]


INJECTIONS = {
    "bare CR": b"X-A: a\rX-Injected: 1\r\n",
    "bare LF": b"X-A: a\nX-Injected: 1\r\n",
    "NUL": b"X-A: a\x00X-Injected: 1\r\n",
    "DEL": b"X-A: a\x7f\r\n",
    "obsolete line folding": b"X-A: a\r\n X-Injected: 1\r\n",
    "NUL in a name": b"X-Injected\x00: 1\r\n",
    "space in a name": b"X Injected: 1\r\n",
    "space before the colon": b"X-Injected : 1\r\n",
}


@pytest.mark.parametrize("line", INJECTIONS.values(), ids=INJECTIONS.keys())
async def test_control_characters_in_headers_get_400_and_inject_nothing(gateway, replica, line) -> None:
    [response] = await refused(gateway, request("POST", "/v1/completions", GOOD, headers=line))
    response.openai_error(400)
    await assert_still_serves(gateway, replica)


@pytest.fixture
async def evil() -> AsyncIterator[RecordingReplica]:
    """A server kvgate was not told about: it must never be contacted."""
    async with recording_replica() as started:
        yield started


def evil_authority(evil: RecordingReplica) -> str:
    return evil.url.removeprefix("http://")


FOREIGN_TARGETS: dict[str, Callable[[str], bytes]] = {
    "absolute URI": lambda at: request("POST", f"http://{at}/v1/completions", GOOD),
    "absolute URI with userinfo": lambda at: request("POST", f"http://user:pw@{at}/v1/completions", GOOD),
    "foreign Host header": lambda at: request("POST", "/v1/completions", GOOD).replace(
        b"Host: gateway.test", f"Host: {at}".encode()),
    "forwarding headers": lambda at: request("POST", "/v1/completions", GOOD, headers=(
        f"X-Forwarded-Host: {at}\r\nForwarded: host={at}\r\nX-Forwarded-For: {at}\r\n").encode()),
}


@pytest.mark.parametrize("build", FOREIGN_TARGETS.values(), ids=FOREIGN_TARGETS.keys())
async def test_foreign_hosts_in_the_request_never_redirect_it(gateway, replica, evil, build) -> None:
    [response] = parse_responses(await exchange(address(gateway), build(evil_authority(evil))))
    assert response.status == 200
    [received] = replica.received
    assert received.path_qs == "/v1/completions" and received.body == GOOD
    assert received.headers["Host"] == replica.url.removeprefix("http://")
    assert evil.received == []


async def test_connect_to_a_foreign_host_is_refused(gateway, replica, evil) -> None:
    authority = evil_authority(evil)
    raw = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode()
    [response] = await refused(gateway, raw)
    response.openai_error(404)
    assert evil.received == []
    await assert_still_serves(gateway, replica)


# Targets that try to climb out of a route; aiohttp matches routes on the decoded path without resolving
# dot segments, so each is an unknown path.
TRAVERSALS = [
    "/v1/../admin",
    "/v1/chat/completions/../../metrics",
    "/v1/completions/../chat/completions",
    "/v1/%2e%2e/metrics",
    "/v1/chat/completions/%2E%2E/%2E%2E/debug/fleet",
    "/v1/completions/..%2f..%2fmetrics",
    "/%2e%2e/%2e%2e/etc/passwd",
]


@pytest.mark.parametrize("target", TRAVERSALS)
async def test_path_traversal_reaches_no_replica(gateway, replica, target) -> None:
    [response] = await refused(gateway, request("POST", target, GOOD))
    assert "no route" in response.openai_error(404)["message"]
    await assert_still_serves(gateway, replica)


async def test_encoded_route_is_forwarded_only_as_the_route_itself(gateway, replica) -> None:
    [response] = parse_responses(await exchange(address(gateway), request("POST", "/v1/%63ompletions?x=/../../a",
                                                                         GOOD)))
    assert response.status == 200
    [received] = replica.received
    assert received.path_qs.split("?")[0] in ROUTE_KINDS
    assert received.path_qs == "/v1/completions?x=/../../a"


async def test_network_path_target_is_not_a_host(gateway, replica, evil) -> None:
    [response] = await refused(gateway, request("POST", f"//{evil_authority(evil)}/v1/completions", GOOD))
    response.openai_error(404)
    assert evil.received == []
    await assert_still_serves(gateway, replica)


async def test_request_head_sent_too_slowly_is_cut_off(gateway, replica) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(*address(gateway))
    started = loop.time()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway.test\r\n")

    async def dribble() -> None:
        for _ in range(40):  # one header byte every 0.1 s, for at most 4 s
            await asyncio.sleep(0.1)
            if writer.is_closing() or reader.at_eof():
                return
            writer.write(b"X")

    dribbler = asyncio.create_task(dribble())
    try:
        received = await read_until_closed(reader, TIGHT["header_timeout"] + SLACK_S)
    finally:
        dribbler.cancel()
        writer.close()
    assert received == b""  # cut off without an answer, as nginx does
    assert loop.time() - started < TIGHT["header_timeout"] + SLACK_S
    await assert_still_serves(gateway, replica)


async def test_connection_that_never_sends_is_closed_after_the_header_timeout(gateway) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(*address(gateway))
    started = loop.time()
    try:
        assert await read_until_closed(reader, TIGHT["header_timeout"] + SLACK_S) == b""
    finally:
        writer.close()
    assert loop.time() - started >= TIGHT["header_timeout"] * 0.9


async def test_idle_keepalive_connection_is_reused_then_closed_after_the_keepalive_timeout(replica) -> None:
    async with running_gateway(endpoints=[replica.url], header_timeout=5, keepalive_timeout=0.6) as gw:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(*address(gw))
        health = b"GET /healthz HTTP/1.1\r\nHost: gateway.test\r\n\r\n"
        try:
            for _ in range(2):  # the second request reuses the connection after a short idle spell
                writer.write(health)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200")
                await reader.readexactly(len(b'{"status":"ok"}'))
                await asyncio.sleep(0.2)
            idle_since = loop.time()
            assert await read_until_closed(reader, 0.6 + SLACK_S) == b""
        finally:
            writer.close()
        assert loop.time() - idle_since >= 0.6 * 0.5


OVERSIZED = {
    "request line": (request("GET", "/healthz?q=" + "a" * 9000), 400),
    "header field": (request("GET", "/healthz", headers=b"X-Big: " + b"a" * 20000 + b"\r\n"), 431),
    "too many header fields": (request("GET", "/healthz", headers=b"".join(b"X-%d: 1\r\n" % i for i in range(200))),
                               431),
}


@pytest.mark.parametrize(("raw", "status"), OVERSIZED.values(), ids=OVERSIZED.keys())
async def test_oversized_heads_get_400_or_431_and_the_connection_closes(gateway, replica, raw, status) -> None:
    # No Connection: close header reaches the parser before it gives up, so the close is the gateway's own.
    [response] = await refused(gateway, raw.replace(b"Connection: close\r\n", b""))
    response.openai_error(status)
    await assert_still_serves(gateway, replica)


async def test_large_header_within_the_limits_is_forwarded(gateway, replica) -> None:
    big = b"X-Big: " + b"a" * 8000 + b"\r\n"  # under the replica's own aiohttp limit too
    [response] = parse_responses(await exchange(address(gateway), request("POST", "/v1/completions", GOOD,
                                                                         headers=big)))
    assert response.status == 200
    assert replica.received[0].headers["X-Big"] == "a" * 8000


async def open_served(addr: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A keep-alive connection the gateway has provably accepted: it answered a request on it."""
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway.test\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    await reader.readexactly(len(b'{"status":"ok"}'))
    return reader, writer


async def test_connections_past_the_limit_get_503_and_a_freed_slot_is_reused(replica) -> None:
    async with running_gateway(endpoints=[replica.url], max_connections=5, header_timeout=5) as gw:
        guard = gw.server.guards[0]
        served = [await open_served(address(gw)) for _ in range(5)]
        try:
            assert guard.served == 5
            [refusal] = parse_responses(await exchange(address(gw), request("GET", "/healthz")))
            refusal.openai_error(503)
            assert refusal.headers["Retry-After"] == "1"
            served.pop()[1].close()
            await wait_until(lambda: guard.served == 4)
            served.append(await open_served(address(gw)))
        finally:
            for _, writer in served:
                writer.close()
        await wait_until(lambda: guard.served == 0 and guard.refusing == 0)
        await assert_still_serves(gw, replica)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
async def test_a_thousand_idle_connections_are_refused_without_leaking_descriptors(replica) -> None:
    async with running_gateway(endpoints=[replica.url], max_connections=50, header_timeout=10) as gw:
        guard = gw.server.guards[0]
        baseline = open_descriptors()
        connections = await asyncio.gather(*(asyncio.open_connection(*address(gw)) for _ in range(1000)))
        try:
            await wait_until(lambda: guard.served == 50)

            async def outcome(reader: asyncio.StreamReader) -> bytes:
                try:
                    return await asyncio.wait_for(reader.read(), 1.0)
                except asyncio.TimeoutError:
                    return b"held open"

            answers = await asyncio.gather(*(outcome(reader) for reader, _ in connections))
        finally:
            for _, writer in connections:
                writer.close()
        refusals = [answer for answer in answers if answer != b"held open"]
        assert len(refusals) == 950
        for answer in set(refusals):  # every refusal is the same clear 503, none a bare reset
            parse_responses(answer)[0].openai_error(503)
        await wait_until(lambda: guard.served == 0 and guard.refusing == 0)
        await wait_until(lambda: open_descriptors() <= baseline + 5)
        await assert_still_serves(gw, replica)


async def test_unknown_expectation_gets_a_json_417(gateway, replica) -> None:
    [response] = await refused(gateway, request("POST", "/v1/completions", GOOD, headers=b"Expect: teapot\r\n"))
    response.openai_error(417)
    await assert_still_serves(gateway, replica)


async def test_compressed_body_reaches_the_replica_decoded_and_labelled_so(gateway, replica) -> None:
    gzipped = gzip.compress(GOOD)
    [response] = await refused(gateway, request("POST", "/v1/completions", gzipped,
                                                headers=b"Content-Encoding: gzip\r\n"))
    assert response.status == 200
    [received] = replica.received
    assert received.body == GOOD and "Content-Encoding" not in received.headers
