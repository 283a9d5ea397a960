"""vLLM's KV-cache event publisher: a ZMQ PUB socket for live batches and a ROUTER socket that replays them.

Every batch goes out as `[topic, sequence, payload]` with sequences from 0, and stays in a bounded
buffer; a replay request `[b"", start (8 bytes)]` from a DEALER or REQ socket is answered with
`[b"", sequence, payload]` for each buffered batch from `start` on, then `[b"", -1, b""]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvgate.engine.kv_events import END_OF_REPLAY, KvEvent, encode_batch, encode_seq

log = logging.getLogger(__name__)

_REBIND_ATTEMPTS = 40
_REBIND_PAUSE_S = 0.05


class KvEventPublisher:
    """Publishes one replica's KV events and serves replays of the recent ones."""

    def __init__(self, topic: str, buffer_batches: int) -> None:
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._context = zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._next_seq = 0
        self._drop = 0
        self.endpoint = ""
        self.replay_endpoint = ""

    async def start(self, host: str, port: int, replay_port: int) -> None:
        """Bind both sockets (port 0: an ephemeral port) and serve replays until stopped."""
        self._pub = self._context.socket(zmq.PUB)
        self._replay = self._context.socket(zmq.ROUTER)
        self.endpoint = await _bind(self._pub, host, port)
        self.replay_endpoint = await _bind(self._replay, host, replay_port)
        self._replay_task = asyncio.create_task(self._serve_replays(), name="sim-kv-replay")
        log.info("sim kv events publishing endpoint=%s replay=%s", self.endpoint, self.replay_endpoint)

    async def stop(self) -> None:
        """Close both sockets."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Send one batch (never blocks: a PUB socket drops what no subscriber can take)."""
        if not events or self._pub is None:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        payload = encode_batch(time.time(), events)
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1  # lost on the wire, still replayable
            return
        with contextlib.suppress(zmq.ZMQError):
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)

    @property
    def last_seq(self) -> int:
        """Sequence number of the latest batch (-1 before the first)."""
        return self._next_seq - 1

    def drop_next(self, count: int) -> None:
        """Lose the next `count` batches on the wire (a subscriber sees a sequence gap)."""
        self._drop = count

    async def restart(self) -> None:
        """Close and bind again on the same ports, with the sequence from 0 and an empty buffer: a restarted engine."""
        await self.stop()
        self._next_seq = 0
        self._buffer.clear()
        self._drop = 0
        await self.start(*_host_and_port(self.endpoint), _host_and_port(self.replay_endpoint)[1])

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("sim kv events: invalid replay request frames=%d", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", encode_seq(seq), payload))
            await self._replay.send_multipart((client, b"", encode_seq(END_OF_REPLAY), b""))


def _host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host, int(port)


async def _bind(socket: zmq.asyncio.Socket, host: str, port: int) -> str:
    """Bind to host:port (0: any free port) and return the address a subscriber connects to.

    ZMQ releases a closed socket's port in its own thread, so binding a port again right after a restart retries.
    """
    if not port:
        return f"tcp://{host}:{socket.bind_to_random_port(f'tcp://{host}')}"
    for _ in range(_REBIND_ATTEMPTS):
        try:
            socket.bind(f"tcp://{host}:{port}")
            return f"tcp://{host}:{port}"
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            await asyncio.sleep(_REBIND_PAUSE_S)
    socket.bind(f"tcp://{host}:{port}")  # the last attempt raises what it finds
    return f"tcp://{host}:{port}"
