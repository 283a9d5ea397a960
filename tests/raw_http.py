"""Speaking HTTP/1.1 over raw sockets, for requests a client library would refuse to send."""

from __future__ import annotations

import asyncio
import http.client
import io
from dataclasses import dataclass
from typing import Any

import orjson

Address = tuple[str, int]


@dataclass(frozen=True)
class RawResponse:
    """One response as the server sent it."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def openai_error(self, status: int) -> dict[str, Any]:
        """The `error` object, after checking the status and that the body has exactly the OpenAI error shape."""
        assert self.status == status, (self.status, self.body)
        assert self.headers.get_content_type() == "application/json"
        payload = orjson.loads(self.body)
        assert set(payload) == {"error"}
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == status and error["message"] and error["type"].endswith("Error")
        return error


class _Unclosable(io.BytesIO):
    """http.client closes its file after each response; the next response is in the same bytes."""

    def close(self) -> None:
        pass


class _Received:
    """The one thing http.client asks of a socket: a file to read the server's bytes from."""

    def __init__(self, data: bytes) -> None:
        self.file = _Unclosable(data)

    def makefile(self, mode: str) -> io.BytesIO:
        return self.file


def parse_responses(data: bytes) -> list[RawResponse]:
    """Every response in `data`, in order; http.client does the parsing."""
    received = _Received(data)
    responses = []
    while received.file.tell() < len(data):
        response = http.client.HTTPResponse(received)  # type: ignore[arg-type]
        response.begin()
        responses.append(RawResponse(response.status, response.headers, response.read()))
    return responses


async def exchange(address: Address, *pieces: bytes, pause: float = 0.0, timeout: float = 5.0) -> bytes:
    """Send `pieces` on a new connection, `pause` seconds apart; return all the server sent until it closed."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        for index, piece in enumerate(pieces):
            if index and pause:
                await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()
        # Times out (failing the test) if the server keeps the connection open.
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """All the server sends until it closes the connection (a reset counts as closing)."""
    received = b""
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk


def request(method: str, target: str, body: bytes | None = None, *, headers: bytes = b"",
            close: bool = True) -> bytes:
    """An HTTP/1.1 request, byte for byte: `headers` are raw header lines, each ending in CRLF."""
    head = f"{method} {target} HTTP/1.1\r\nHost: gateway.test\r\n".encode()
    if body is not None:
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    if close:
        head += b"Connection: close\r\n"
    return head + headers + b"\r\n" + (body or b"")
