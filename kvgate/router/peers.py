"""Routing decisions shared among gateway replicas, so that approximate routing is the same on every one of them.

Without KV events a gateway knows what a replica caches only from what it sent there itself. Behind a Service
that spreads clients over several gateways, each sees part of every conversation: a turn whose earlier turns
another gateway moved off its tenant's home goes back home and prefills its history again. Each gateway
therefore publishes every decision it makes (the replica and what routing read of the request: its block
hashes, anchor and opening) on a ZMQ PUB socket (`peer_listen`), and subscribes to the other gateways' sockets
(`peers`, or on Kubernetes the pods behind `peer_service`, a headless Service over the gateway's pods whose port
is named `peers`, followed as they come and go); a decision learned from a peer enters the prefix index, the
recent shares and the tenants' popularity as one of its own would (`Policy.learn`), and counts on its replica
until the next scrape shows it (`Fleet.sent_elsewhere`). Every gateway then routes from the whole fleet's
history and load. Where routing is precise (KV events), a decision carries the prompt's token ids too, so that
every gateway counts its blocks as held on the chosen replica until the engine's events show them, as the
gateway that made it does; a prompt over `MAX_SHARED_TOKENS` travels without them (peers then learn it
approximately).

Delivery is best effort, as the state it feeds is a belief: a peer that is down or slow loses decisions (PUB
drops beyond its high-water mark; ZMQ reconnects by itself), never blocks a request. Decisions travel as one
msgpack frame; a frame that does not decode, or names a replica this gateway does not route to, is counted and
dropped. A gateway's own decisions (its address may be among `peers`) are recognised by its random origin id.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection, Sequence
from typing import Annotated
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from kvgate.endpoints.discovery import Discovery
from kvgate.endpoints.types import Endpoint
from kvgate.policies.types import RequestInfo

log = logging.getLogger(__name__)

PEERS_PORT_NAME = "peers"  # the port of `peer_service` that peers publish on
HIGH_WATER_MARK = 10_000  # decisions queued per peer before the publisher drops
MAX_FRAME_BYTES = 1 << 20  # a peer sending more in one decision is cut off (ZMQ disconnects it)
MAX_SHARED_TOKENS = 131_072  # token ids a decision carries at most: 5 bytes each, well inside the frame bound

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]  # hashed as uint32, as the tokenizer's ids are


class SharedDecision(msgspec.Struct, array_like=True, frozen=True):
    """One routing decision as it travels between gateways: what `Policy.learn` needs of the request."""

    origin: str  # the publishing gateway's random id
    replica: str  # the endpoint key it chose
    model: str
    block_hashes: tuple[int, ...]
    anchor_blocks: int
    opening_blocks: int
    prompt_chars: int
    cache_salt: str | None = None
    token_ids: tuple[TokenId, ...] | None = None  # the prompt as its engine tokenizes it (precise routing)
    anchor_tokens: int = 0  # of those, its anchor's

    @classmethod
    def of(cls, origin: str, request: RequestInfo, replica: str) -> SharedDecision:
        """The decision to send `request` to `replica`."""
        tokens = request.token_ids if request.token_ids and len(request.token_ids) <= MAX_SHARED_TOKENS else None
        return cls(origin, replica, request.model, request.block_hashes, request.anchor_blocks,
                   request.opening_blocks, request.prompt_chars, request.cache_salt, tokens,
                   request.anchor_tokens if tokens else 0)

    def request(self) -> RequestInfo:
        """The request as routing reads it."""
        return RequestInfo(model=self.model, block_hashes=self.block_hashes, anchor_blocks=self.anchor_blocks,
                           opening_blocks=self.opening_blocks, prompt_chars=self.prompt_chars,
                           cache_salt=self.cache_salt, token_ids=self.token_ids, anchor_tokens=self.anchor_tokens)


class DecisionPeers:
    """Publishes this gateway's decisions and feeds the other gateways' to it (`routed_elsewhere`)."""

    def __init__(self, listen: tuple[str, int] | None, peers: Sequence[tuple[str, int]],
                 routed_elsewhere: Callable[[RequestInfo, str], bool], count: Callable[[str], None],
                 discovery: Discovery | None = None) -> None:
        self.origin = os.urandom(8).hex()
        self._listen = listen
        self._static = frozenset(peers)
        self._discovery = discovery  # the peers' pods, besides the static ones
        self._connected: set[tuple[str, int]] = set()
        self._routed_elsewhere = routed_elsewhere  # False: this gateway does not know the replica
        self._count = count  # one event: published, dropped, learned, unknown_replica, invalid
        self._context = zmq.Context()  # the publisher's sends never wait: a plain socket, NOBLOCK
        self._async_context = zmq.asyncio.Context()
        self._publisher: zmq.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(SharedDecision)

    @property
    def subscribed(self) -> list[str]:
        """The peers' publishers this gateway is subscribed to, as HOST:PORT."""
        return sorted(f"{host}:{port}" for host, port in self._connected)

    def open(self) -> None:
        """Bind the publisher (so a taken port stops the gateway at start-up, not later)."""
        if self._listen is not None:
            host, port = self._listen
            self._publisher = self._context.socket(zmq.PUB)
            self._publisher.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
            self._publisher.setsockopt(zmq.LINGER, 0)
            self._publisher.bind(_tcp("*" if host in ("", "0.0.0.0") else host, port))

    def publish(self, request: RequestInfo, replica: str) -> None:
        """Tell the peers that this gateway sent `request` to `replica`; never waits."""
        if self._publisher is None:
            return
        frame = self._encoder.encode(SharedDecision.of(self.origin, request, replica))
        try:  # a full PUB queue drops silently; a send can fail only once the socket is closed (shut down)
            self._publisher.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            self._count("dropped")
            return
        self._count("published")

    async def run(self) -> None:
        """Learn the peers' decisions until cancelled, following the peers discovery reports."""
        if not self._static and self._discovery is None:
            return
        subscriber = self._async_context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        self._follow(subscriber, self._static)
        discovered = asyncio.create_task(self._discovery.run(
            lambda endpoints: self._follow(subscriber, self._static | {_address(e) for e in endpoints})),
            name="peer-discovery") if self._discovery is not None else None
        try:
            while True:
                self._learn(await subscriber.recv())
        finally:
            if discovered is not None:
                discovered.cancel()
                await asyncio.gather(discovered, return_exceptions=True)
            subscriber.close()

    def _follow(self, subscriber: zmq.asyncio.Socket, peers: Collection[tuple[str, int]]) -> None:
        """Subscribe to exactly `peers`: connect to the new ones, disconnect from those gone."""
        for host, port in set(peers) - self._connected:
            subscriber.connect(_tcp(host, port))
        for host, port in self._connected - set(peers):
            subscriber.disconnect(_tcp(host, port))
        changed = set(peers) != self._connected
        self._connected = set(peers)
        if changed:
            log.info("peers subscribed=%s", ",".join(self.subscribed) or "-")

    def _learn(self, frame: bytes) -> None:
        try:
            decision = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._count("invalid")
            return
        if decision.origin == self.origin:
            return
        self._count("learned" if self._routed_elsewhere(decision.request(), decision.replica) else "unknown_replica")

    def close(self) -> None:
        """Close the publisher and the ZMQ context."""
        if self._publisher is not None:
            self._publisher.close()
        self._context.destroy(linger=0)
        self._async_context.destroy(linger=0)


def _tcp(host: str, port: int) -> str:
    """A ZMQ tcp address: IPv6 hosts in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _address(endpoint: Endpoint) -> tuple[str, int]:
    """A discovered peer pod's host and `peers` port."""
    parts = urlsplit(endpoint.url)
    return parts.hostname or "", parts.port or 0
