"""Fuzzing one running gateway: whatever body or headers a client sends, the answer is well-formed HTTP, every
gateway error is OpenAI-shaped, only valid requests reach the replica (byte-identical), and the gateway stays up."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.router.requests import ROUTE_KINDS
from tests.harness import RunningGateway, running_gateway
from tests.recording_replica import MODEL, RecordingReplica, recording_replica

T = TypeVar("T")

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class LiveGateway:
    """A gateway and its replica running on a background event loop, driven from synchronous hypothesis tests."""

    loop: asyncio.AbstractEventLoop
    gateway: RunningGateway
    replica: RecordingReplica
    client: aiohttp.ClientSession

    def run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine on the gateway's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzzed-gateway", daemon=True)
    thread.start()
    stack = AsyncExitStack()

    async def start() -> LiveGateway:
        replica = await stack.enter_async_context(recording_replica())
        gateway = await stack.enter_async_context(running_gateway(endpoints=[replica.url]))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        return LiveGateway(loop, gateway, replica, client)

    started = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield started
    finally:
        started.run(stack.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture(autouse=True)
def no_error_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fuzzed input is expected: it must never be logged as an error or with a traceback."""
    caplog.set_level(logging.INFO)
    yield
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
# Objects shaped like inference requests, right or wrong in each field.
request_like = st.fixed_dictionaries(
    {"model": st.just(MODEL) | json_values},
    optional={name: json_values | st.text(max_size=20) | st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}), max_size=2)
        for name in ("prompt", "messages", "input", "stream", "max_tokens")},
)
bodies = st.one_of(st.binary(max_size=300), json_values.map(orjson.dumps), request_like.map(orjson.dumps))
paths = st.sampled_from([*ROUTE_KINDS, "/v1/models", "/healthz", "/v1/nope"])
# What an HTTP client library lets through: token names, visible-ASCII values; the client frames the body.
header_names = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~"),
                       min_size=1, max_size=24).filter(lambda n: n.lower() not in
                                                       ("content-length", "transfer-encoding", "host"))
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60).map(str.strip)
known_headers = st.sampled_from(["Content-Type", "Content-Encoding", "Connection", "Expect", "Upgrade",
                                 "X-Request-Id", "Authorization", "Cookie", "TE", "Trailer", "Keep-Alive"])
headers = st.dictionaries(known_headers | header_names, header_values, max_size=8)


async def exchange(live: LiveGateway, method: str, path: str, body: bytes,
                   sent_headers: dict[str, str]) -> tuple[int, bytes, str]:
    """Send one request through the client library; (status, body, content type) of the answer."""
    async with live.client.request(method, live.gateway.url + path, data=body, headers=sent_headers,
                                   allow_redirects=False) as resp:
        return resp.status, await resp.read(), resp.content_type


def check_answer(live: LiveGateway, path: str, body: bytes, answer: tuple[int, bytes, str], before: int) -> None:
    """The answer is well-formed, errors are OpenAI-shaped, and only a valid request reached the replica, intact."""
    status, payload, content_type = answer
    assert 200 <= status <= 599
    forwarded = live.replica.received[before:]
    if status >= 400:  # the replica only ever answers 200: any error is the gateway's own
        assert content_type == "application/json"
        error = orjson.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert forwarded == []
    elif path in ROUTE_KINDS:
        assert [(r.path_qs, r.body) for r in forwarded] == [(path, body)]
    else:
        assert forwarded == []


def assert_alive(live: LiveGateway) -> None:
    async def health() -> int:
        async with live.client.get(live.gateway.url + "/healthz") as resp:
            return resp.status

    assert live.run(health()) == 200


@FUZZ
@given(data=st.data())
def test_fuzzed_bodies_get_well_formed_answers(live: LiveGateway, data: st.DataObject) -> None:
    path = data.draw(paths)
    method = "POST" if path in ROUTE_KINDS else data.draw(st.sampled_from(["GET", "POST", "PUT"]))
    body = data.draw(bodies)
    before = len(live.replica.received)
    answer = live.run(exchange(live, method, path, body, {"Content-Type": "application/json"}))
    check_answer(live, path, body, answer, before)
    assert_alive(live)


@FUZZ
@given(data=st.data())
def test_fuzzed_headers_get_well_formed_answers(live: LiveGateway, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(list(ROUTE_KINDS)))
    body = data.draw(st.sampled_from([orjson.dumps({"model": MODEL, "prompt": "hi"}), b"{}"]) | bodies)
    sent: dict[str, Any] = data.draw(headers)
    before = len(live.replica.received)
    answer = live.run(exchange(live, "POST", path, body, sent))
    check_answer(live, path, body, answer, before)
    assert_alive(live)
