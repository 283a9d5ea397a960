"""Back-pressure over real sockets: a slow client slows the replica instead of filling the gateway's memory,
and many idle connections neither block serving nor leak descriptors."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from kvgate.loadtest.soak.load import SlowReader, post_request
from tests.harness import RunningGateway, running_gateway, scripted_replica, sse_event, wait_until

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
CHAT_PATH = "/v1/chat/completions"
MB = 2**20
EVENT = sse_event(b'{"choices":[{"delta":{"content":"' + b"x" * (64 * 1024) + b'"}}]}')
TOTAL_EVENTS = 50 * MB // len(EVENT) + 1  # the replica would send about 50 MB if nothing held it back
# The gateway's own buffers for one stream: aiohttp's upstream read buffer (paused at its high-water mark, plus one
# socket read) and the client transport's write buffer (one chunk past its high-water mark). About 1 MB measured.
GATEWAY_BUFFER_LIMIT = 4 * MB
REPLICA_SEND_BUFFER = 64 * 1024


def kernel_send_buffer_max() -> int:
    """The most Linux lets a TCP send buffer autotune to: the gateway's socket to a slow client may hold this."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as limits:
        return int(limits.read().split()[2])


@dataclass
class FloodingReplica:
    """Streams ~50 MB of SSE as fast as the gateway takes it, counting what its writes handed over."""

    written: int = 0
    finished: bool = False
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        # A small kernel buffer on the replica's side, so what piles up ahead of the client is the gateway's doing.
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, REPLICA_SEND_BUFFER)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for _ in range(TOTAL_EVENTS):
                await response.write(EVENT)  # returns once the transport has drained below its high-water mark
                self.written += len(EVENT)
            await response.write(sse_event(b"[DONE]"))
            self.finished = True
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise
        return response


@pytest.fixture
async def flooding() -> AsyncIterator[tuple[FloodingReplica, RunningGateway]]:
    replica = FloodingReplica()
    async with scripted_replica([("POST", CHAT_PATH, replica.handle)]) as url, \
            running_gateway(endpoints=[url], idle_timeout=0.5) as gw:
        yield replica, gw


async def open_stream(gw: RunningGateway) -> SlowReader:
    host, port = gw.server.addresses[0]
    client = await SlowReader.open(host, port, receive_buffer=4096)
    await client.send(post_request(host, port, CHAT_PATH, CHAT))
    return client


async def read_until_replica_stalls(replica: FloodingReplica, client: SlowReader, max_seconds: float = 8.0) -> None:
    """Read a few bytes every 100 ms until the replica has written nothing more for a second."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_seconds
    last_written, still_since = -1, loop.time()
    while loop.time() < deadline:
        await client.read_some(64)
        if replica.written != last_written:
            last_written, still_since = replica.written, loop.time()
        elif replica.written and loop.time() - still_since >= 1.0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the replica never stalled: it wrote {replica.written} bytes in {max_seconds}s")


async def test_slow_client_holds_back_the_replica_instead_of_filling_gateway_memory(flooding) -> None:
    replica, gw = flooding
    tracemalloc.start()
    try:
        client = await open_stream(gw)
        await wait_until(lambda: replica.written > 0)
        memory_before, _ = tracemalloc.get_traced_memory()
        await read_until_replica_stalls(replica, client)
        memory_growth = tracemalloc.get_traced_memory()[0] - memory_before
    finally:
        tracemalloc.stop()
    assert client.status() == 200
    assert not replica.finished
    # The replica's writes block: it got only a bounded amount ahead of what the client read, the gateway's
    # buffers plus what the kernel holds in the gateway's socket to the client (up to tcp_wmem's maximum).
    in_transit = replica.written - client.received
    assert in_transit < GATEWAY_BUFFER_LIMIT + kernel_send_buffer_max(), (replica.written, client.received)
    # The Python heap of this process (gateway, replica and client together) stays within the gateway's buffers.
    assert memory_growth < GATEWAY_BUFFER_LIMIT, memory_growth
    client.close()
    await asyncio.wait_for(replica.aborted.wait(), 5)
    await wait_until(lambda: gw.gateway.fleet.in_flight(gw.gateway.fleet.endpoints[0].key) == 0)


async def test_client_that_stops_reading_is_not_taken_for_a_stalled_replica(flooding) -> None:
    replica, gw = flooding
    client = await open_stream(gw)
    await wait_until(lambda: replica.written > 0)
    await asyncio.sleep(1.5)  # three idle timeouts without reading: the gateway's upstream reads are paused
    assert await client.read_some(4096)
    # The replica is still streaming and has not been marked as failed: pausing stopped the idle timer.
    assert not replica.aborted.is_set()
    errors = gw.gateway.metrics.upstream_errors.collect()[0].samples
    assert not [s for s in errors if s.name.endswith("_total") and s.value], errors
    client.close()
    await asyncio.wait_for(replica.aborted.wait(), 5)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def idle_after_one_request(host: str, port: int) -> asyncio.StreamWriter:
    """A keep-alive connection that has been answered once and then sends nothing more."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway.test\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return writer


async def silent(host: str, port: int) -> asyncio.StreamWriter:
    """A connection that never sends a byte."""
    _, writer = await asyncio.open_connection(host, port)
    return writer


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
async def test_five_hundred_idle_connections_neither_block_a_stream_nor_leak_descriptors() -> None:
    async def short_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(3):
            await response.write(sse_event(b'{"n": %d}' % n))
        await response.write(sse_event(b"[DONE]"))
        return response

    async with scripted_replica([("POST", CHAT_PATH, short_stream)]) as url, \
            running_gateway(endpoints=[url], header_timeout=30) as gw, aiohttp.ClientSession() as client:
        host, port = gw.server.addresses[0]
        guard = gw.server.guards[0]
        async with client.post(gw.url + CHAT_PATH, json=CHAT) as warmup:  # pools the upstream connection
            await warmup.read()
        await client.close()
        await wait_until(lambda: guard.served == 0)
        baseline = open_descriptors()
        idle = await asyncio.gather(*(silent(host, port) for _ in range(250)),
                                    *(idle_after_one_request(host, port) for _ in range(250)))
        try:
            await wait_until(lambda: guard.served == 500)
            assert open_descriptors() >= baseline + 990  # both ends of each connection live in this process
            async with aiohttp.ClientSession() as fresh:
                async with fresh.post(gw.url + CHAT_PATH, json=CHAT, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    assert resp.status == 200
                    body = await resp.read()
            assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
        finally:
            for writer in idle:
                writer.close()
        await wait_until(lambda: guard.served == 0)
        await wait_until(lambda: open_descriptors() <= baseline + 5)  # pooled upstream and poller sockets come and go


def test_a_low_open_file_hard_limit_lowers_max_connections_instead_of_warning_at_every_start() -> None:
    code = ("import logging, resource, sys; logging.basicConfig(stream=sys.stderr, level=logging.INFO); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (1200, 1200)); "
            "from kvgate.router.limits import raise_open_file_limit; "
            "print(raise_open_file_limit(10000), raise_open_file_limit(20), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["58", "20", "1200"]  # (1200 - 1024 spare) // 3 files per connection
    assert "INFO" in done.stderr and "max_connections lowered to 58" in done.stderr and "WARNING" not in done.stderr
