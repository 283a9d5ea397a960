"""A raw HTTP/1.1 client that reads its response a few bytes at a time through a tiny receive buffer."""

from __future__ import annotations

import asyncio
import socket

import orjson

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
