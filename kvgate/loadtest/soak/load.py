"""The soak's traffic: steady streaming chats plus periodic faulty clients, each request tallied by outcome."""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from kvgate.loadtest.kit.stream import CHAT_PATH, stream_chat
from kvgate.loadtest.routing.workload import system_prompt, user_message

OK = "ok"
LOST_PREFIX = "lost"  # the gateway neither finished the request nor answered it with an error
_REQUEST_TIMEOUT_S = 60.0
_RAW_TIMEOUT_S = 10.0
_SYSTEM_PROMPT_CHARS = 800
_USER_MESSAGE_CHARS = 200
_TENANTS = 24

# Requests a well-behaved client library would refuse to send; each must get a 4xx, never a hang or a 5xx.
MALFORMED_REQUESTS: dict[str, bytes] = {
    "garbage_request_line": b"\x01\x02 nonsense\r\n\r\n",
    "invalid_json": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 9\r\nConnection: close\r\n\r\n{not json",
    "missing_model": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 16\r\nConnection: close\r\n\r\n{\"messages\": []}",
    "oversized_header": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    "bad_chunk_size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
}


@dataclass(frozen=True, slots=True)
class LoadShape:
    """What the clients send and how many of each kind run."""

    model: str
    concurrency: int  # steady streaming clients
    max_tokens: int
    think_s: float  # a steady client pauses up to this long (uniformly) between requests
    fault_interval_s: float  # a round of faulty clients starts this often
    aborts_per_round: int  # clients that disconnect after the first event
    slow_readers_per_round: int
    slow_reader_max_tokens: int
    slow_read_bytes: int  # a slow reader reads this much ...
    slow_read_interval_s: float  # ... this often
    slow_read_max_s: float
    seed: int = 0


def outcome_of_stream(error: str | None) -> str:
    """The outcome of one streamed chat, from the error `stream_chat` reported."""
    if error is None:
        return OK
    if error.startswith("HTTP "):
        return "http_" + error[5:8]
    if error.startswith("stream error"):
        return "error_event"  # the gateway ended the stream with an OpenAI error event and [DONE]
    if error.startswith("stream ended without"):
        return f"{LOST_PREFIX}_truncated"
    return f"{LOST_PREFIX}_{error.split(':', 1)[0]}"  # an exception: reset, timeout, ...


class Tally:
    """Requests started and their outcomes, by kind of client."""

    def __init__(self) -> None:
        self.started: Counter[str] = Counter()
        self.outcomes: Counter[tuple[str, str]] = Counter()

    def start(self, kind: str) -> None:
        """A request of `kind` was sent."""
        self.started[kind] += 1

    def finish(self, kind: str, outcome: str) -> None:
        """A request of `kind` ended with `outcome`."""
        self.outcomes[kind, outcome] += 1

    def lost(self) -> int:
        """Requests that got no answer, or were never accounted for."""
        unaccounted = sum(self.started.values()) - sum(self.outcomes.values())
        return unaccounted + sum(n for (_, outcome), n in self.outcomes.items() if outcome.startswith(LOST_PREFIX))

    def to_json(self) -> dict[str, Any]:
        """Per kind: started, and the count of each outcome."""
        return {kind: {"started": started, "outcomes": {outcome: n for (k, outcome), n in sorted(self.outcomes.items())
                                                        if k == kind}}
                for kind, started in sorted(self.started.items())}


class SoakLoad:
    """Steady streaming clients and periodic faulty ones against one gateway URL, until a deadline."""

    def __init__(self, url: str, shape: LoadShape) -> None:
        self.tally = Tally()
        self._url = url
        address = urlsplit(url)
        self._host, self._port = address.hostname or "127.0.0.1", address.port or 80
        self._shape = shape
        self._rng = random.Random(shape.seed)
        self._numbers = itertools.count()

    async def run(self, seconds: float) -> None:
        """Send traffic for `seconds`; returns once every request started has ended."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            async with asyncio.TaskGroup() as group:
                for _ in range(self._shape.concurrency):
                    group.create_task(self._steady_client(session, deadline))
                group.create_task(self._fault_rounds(session, deadline, group))

    def _chat(self, max_tokens: int) -> dict[str, Any]:
        """A streamed chat: a tenant's shared system prompt and a question of its own."""
        number = next(self._numbers)
        tenant = self._rng.randrange(_TENANTS)
        return {"model": self._shape.model, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "system", "content": system_prompt(tenant, _SYSTEM_PROMPT_CHARS)},
                             {"role": "user", "content": user_message(number, 0, _USER_MESSAGE_CHARS)}]}

    async def _steady_client(self, session: aiohttp.ClientSession, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self._rng.uniform(0, self._shape.think_s))  # spread the first requests out
        while loop.time() < deadline:
            self.tally.start("stream")
            sample, _ = await stream_chat(session, self._url, self._chat(self._shape.max_tokens), 0.0,
                                         _REQUEST_TIMEOUT_S)
            self.tally.finish("stream", outcome_of_stream(sample.error))
            await asyncio.sleep(self._rng.uniform(0, self._shape.think_s))

    async def _fault_rounds(self, session: aiohttp.ClientSession, deadline: float, group: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        shape = self._shape
        while loop.time() + shape.fault_interval_s < deadline:
            await asyncio.sleep(shape.fault_interval_s)
            for _ in range(shape.aborts_per_round):
                group.create_task(self._tallied("abort_mid_stream", lambda: self._abort_mid_stream(session)))
            for name, raw in MALFORMED_REQUESTS.items():
                group.create_task(self._tallied(f"malformed:{name}", functools.partial(self._malformed, raw)))
            for _ in range(shape.slow_readers_per_round):
                group.create_task(self._tallied("slow_reader", self._slow_reader))

    async def _tallied(self, kind: str, attempt: Callable[[], Awaitable[str]]) -> None:
        """Count one request of `kind` and the outcome `attempt` gives; one whose connection failed is lost."""
        self.tally.start(kind)
        try:
            outcome = await attempt()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            outcome = f"{LOST_PREFIX}_{type(exc).__name__}"
        self.tally.finish(kind, outcome)

    async def _abort_mid_stream(self, session: aiohttp.ClientSession) -> str:
        """Read the first event of a stream, then drop the connection."""
        body, headers = orjson.dumps(self._chat(self._shape.max_tokens)), {"Content-Type": "application/json"}
        async with session.post(self._url + CHAT_PATH, data=body, headers=headers) as answer:
            if answer.status != 200:
                await answer.read()
                return f"http_{answer.status}"
            await answer.content.readuntil(b"\n\n")
            answer.close()
            return "aborted"

    async def _malformed(self, raw: bytes) -> str:
        """Send one malformed request and read the answer until the gateway closes."""
        reader, writer = await asyncio.open_connection(self._host, self._port)
        try:
            writer.write(raw)
            answer = await asyncio.wait_for(reader.read(), _RAW_TIMEOUT_S)
        finally:
            writer.transport.abort()
        status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.") else b""
        if not status.isdigit():
            return f"{LOST_PREFIX}_no_answer"
        return "rejected_4xx" if 400 <= int(status) < 500 else f"http_{int(status)}"

    async def _slow_reader(self) -> str:
        """Stream a long answer through a tiny receive buffer, a few hundred bytes at a time."""
        shape = self._shape
        client = await SlowReader.open(self._host, self._port)
        try:
            await client.send(post_request(self._host, self._port, CHAT_PATH, self._chat(shape.slow_reader_max_tokens)))
            closed = await client.read_slowly(shape.slow_read_bytes, shape.slow_read_interval_s, shape.slow_read_max_s)
        finally:
            client.close()
        status = client.status()
        if status is not None and status != 200:
            return f"http_{status}"
        if not closed:
            return f"{LOST_PREFIX}_slow_read_timeout"
        if b"[DONE]" not in client.tail:
            return f"{LOST_PREFIX}_truncated"
        return "error_event" if b'"error"' in client.tail else OK


# asyncio's StreamReader stops reading the socket once it holds twice this: the client buffers almost nothing.
_READER_LIMIT = 1024
_TAIL_BYTES = 512  # enough for an error event and the [DONE] after it


def post_request(host: str, port: int, path: str, body: dict) -> bytes:
    """A POST of `body` as JSON that asks the server to close the connection after answering."""
    payload = orjson.dumps(body)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + payload


class SlowReader:
    """One connection whose owner decides how fast the response is read; counts the bytes it read."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.received = 0
        self.head = b""  # the first bytes of the response, up to the end of its status line at least
        self.tail = b""  # the last bytes read, to spot the end of a stream

    @classmethod
    async def open(cls, host: str, port: int, receive_buffer: int = 4096) -> SlowReader:
        """Connect with SO_RCVBUF set before connecting (so the TCP window starts small too)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock, limit=_READER_LIMIT)
        return cls(reader, writer)

    async def send(self, request: bytes) -> None:
        """Write the whole request."""
        self._writer.write(request)
        await self._writer.drain()

    async def read_some(self, size: int) -> bytes:
        """Up to `size` bytes (b"" once the server has closed)."""
        data = await self._reader.read(size)
        self.received += len(data)
        if len(self.head) < 64:
            self.head += data[: 64 - len(self.head)]
        self.tail = (self.tail + data)[-_TAIL_BYTES:]
        return data

    async def read_slowly(self, size: int, interval: float, max_seconds: float) -> bool:
        """Read `size` bytes every `interval` seconds until the server closes (True) or time runs out (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_seconds
        while loop.time() < deadline:
            try:
                data = await asyncio.wait_for(self.read_some(size), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return False
            if not data:
                return True
            await asyncio.sleep(interval)
        return False

    def status(self) -> int | None:
        """The response's status code, once its status line has been read."""
        parts = self.head.split(b" ", 2)
        return int(parts[1]) if len(parts) > 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None

    def close(self) -> None:
        """Drop the connection at once (an RST when unread data remains), as a client that gives up does."""
        self._writer.transport.abort()
