"""Subscribes to every replica's KV-cache events and keeps the precise prefix index true to them.

One ZMQ SUB socket per replica (address from a `{host}` template or an explicit list), one task each,
never blocking the event loop. A replica's state is precise only while its history is complete:

- a first batch numbered 0 (a fresh engine), or a replay from 0 that the engine's buffer still holds;
- a sequence gap is filled from the replay endpoint when one is configured; otherwise (or when the
  buffer no longer reaches back) the state is cleared and the replica is routed approximately until it
  is rebuilt: an `AllBlocksCleared`, or as many blocks stored since as its cache holds (by then every
  block it held before has been evicted or stored again);
- `AllBlocksCleared`, a sequence that starts again (an engine restart), a lost connection and a replica
  leaving discovery clear its state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgate.endpoints.types import Endpoint
from kvgate.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    decode_seq,
    replay,
)
from kvgate.policies.precise_index import PrecisePrefixIndex

log = logging.getLogger(__name__)

_RECONNECT_MS = 500
_RETRY_S = 5.0  # between two attempts to set up a subscription that failed
# Live batches a SUB socket queues while a replay runs (ZMQ's default of 1,000 would drop some: a new gap).
_RECEIVE_HIGH_WATER_MARK = 100_000
_REPLAY_BATCHES_PER_YIELD = 64  # a long replay lets requests be routed between its slices


class KvEventsAddressError(ValueError):
    """A KV events address setting that cannot be read."""


def _is_zmq_address(address: str) -> bool:
    tcp, ipc = address.removeprefix("tcp://"), address.removeprefix("ipc://")
    return (tcp != address and ":" in tcp) or (ipc != address and bool(ipc))


@dataclass(frozen=True, slots=True)
class KvEventAddresses:
    """Where each replica publishes: a `{host}` template, or explicit replica URL -> ZMQ address pairs."""

    template: str | None = None
    explicit: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, values: Sequence[str], setting: str) -> KvEventAddresses:
        """One template (`tcp://{host}:5557`) or `REPLICA_URL=ADDRESS` items (`tcp://ADDR:PORT`, or `ipc://PATH` for an
        engine on the same host); raises KvEventsAddressError."""
        template = None
        explicit: dict[str, str] = {}
        for value in values:
            replica, sep, address = value.rpartition("=")
            if not sep:
                address = value
            if not _is_zmq_address(address):
                raise KvEventsAddressError(f"{setting}: {value!r} is not tcp://HOST:PORT or ipc://PATH")
            if sep:
                explicit[replica.strip().rstrip("/")] = address
            elif template is not None:
                raise KvEventsAddressError(f"{setting}: give one template, or REPLICA_URL=ADDRESS pairs")
            else:
                template = address
        return cls(template, explicit)

    def __bool__(self) -> bool:
        return self.template is not None or bool(self.explicit)

    def address(self, endpoint: Endpoint) -> str | None:
        """The replica's address: its explicit one, else the template with `{host}` = its address."""
        found = self.explicit.get(endpoint.url) or self.explicit.get(endpoint.key)
        if found or self.template is None:
            return found
        host = urlsplit(endpoint.url).hostname or ""
        return self.template.replace("{host}", f"[{host}]" if ":" in host else host)


@dataclass
class ReplicaEventStats:
    """What one replica's subscription has seen, for /debug/fleet and the metrics."""

    address: str
    replay_address: str | None
    connected: bool = False
    batches: int = 0
    events: int = 0
    gaps: int = 0
    restarts: int = 0
    replays: int = 0
    replay_failures: int = 0
    malformed: int = 0
    last_seq: int | None = None
    rebuilding: bool = False  # history incomplete: waiting for the cache to turn over


class _Subscription:
    """One replica's SUB socket, its replays and what they tell the index."""

    def __init__(self, key: str, stats: ReplicaEventStats, owner: KvEventSubscriber) -> None:
        self._key = key
        self.stats = stats
        self._owner = owner
        self._skip_through = -1  # live batches a replay already applied

    async def run(self) -> None:
        """Subscribe until cancelled; a socket that cannot bind or connect (an address in use, say) is logged and
        tried again every few seconds, the replica routed approximately meanwhile."""
        while True:
            try:
                await self._subscribe()
            except zmq.ZMQError as exc:
                self.stats.connected = False
                self._reset(precise=False)
                log.error("kv events cannot %s replica=%s address=%s error=%s; retrying in %.0f s",
                          "bind" if self._owner.bind else "connect", self._key, self.stats.address, exc, _RETRY_S)
                await asyncio.sleep(_RETRY_S)

    async def _subscribe(self) -> None:
        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
        sub.setsockopt(zmq.RCVHWM, _RECEIVE_HIGH_WATER_MARK)
        sub.setsockopt(zmq.SUBSCRIBE, self._owner.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            if self._owner.bind:
                sub.bind(self.stats.address)  # the engine connects to us (a vLLM endpoint without `*`)
            else:
                sub.connect(self.stats.address)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_monitor(parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    await self._on_message(await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, event: dict) -> None:
        if event["event"] in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            self.stats.connected = True
            log.info("kv events connected replica=%s address=%s", self._key, self.stats.address)
            if self.stats.last_seq is None and self.stats.replay_address:
                # Whatever the engine still buffers tells its whole history when the buffer reaches back to 0.
                await self._recover(0, until=None)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self.stats.connected = False
            log.info("kv events disconnected replica=%s: its state is cleared until it reconnects", self._key)
            self._reset(precise=False)
            self._owner.on_lost(self._key)

    async def _on_message(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise EventDecodeError(f"{len(frames)} frames, expected 3")
            batch = decode_batch(decode_seq(frames[1]), frames[2])
        except EventDecodeError as exc:
            self.stats.malformed += 1
            log.warning("kv events malformed message replica=%s: %s", self._key, exc)
            return
        seq, last = batch.seq, self.stats.last_seq
        if seq <= self._skip_through and last is not None and seq <= last:
            return  # already applied from a replay
        self._skip_through = -1
        if last is None or seq != last + 1:
            if last is not None and seq <= last:
                self.stats.restarts += 1  # the engine's sequence started again: a new engine, an empty cache
                log.info("kv events sequence restarted replica=%s seq=%d last=%d", self._key, seq, last)
            elif last is not None:
                self.stats.gaps += 1
                log.info("kv events gap replica=%s missing=%d..%d", self._key, last + 1, seq - 1)
            start = 0 if last is None or seq <= last else last + 1
            if start == 0:
                self._reset(precise=True)
            if seq > start and not await self._recover(start, until=seq):
                self._reset(precise=False)
                self.stats.rebuilding = True
        self._apply(batch)

    async def _recover(self, start: int, until: int | None) -> bool:
        """Replay batches [start, until) (every buffered one from `start` when None); True when none was missing."""
        if not self.stats.replay_address:
            return False
        self.stats.replays += 1
        expected = start
        reached_end = False
        try:
            async with aclosing(replay(self.stats.replay_address, start, self._owner.replay_timeout_s)) as batches:
                async for seq, payload in batches:
                    if seq < expected or (until is not None and seq >= until):
                        continue  # before the gap, or a batch the live socket delivers itself
                    if seq > expected:
                        break  # the buffer no longer reaches back far enough
                    if expected == 0:
                        self._reset(precise=True)
                    self._apply(decode_batch(seq, payload))
                    self._skip_through = seq
                    expected += 1
                    if expected % _REPLAY_BATCHES_PER_YIELD == 0:
                        await asyncio.sleep(0)
                else:
                    reached_end = True
        except (TimeoutError, EventDecodeError, zmq.ZMQError) as exc:
            log.warning("kv events replay failed replica=%s start=%d: %s", self._key, start, exc or type(exc).__name__)
        complete = reached_end and (until is None or expected == until)
        if complete and until is None and expected == 0:
            self._reset(precise=True)  # the engine never published anything: its cache is empty
        if not complete:
            self.stats.replay_failures += 1
            self.stats.rebuilding = True
            self._owner.index.set_precise(self._key, False)
        return complete

    def _apply(self, batch: EventBatch) -> None:
        index = self._owner.index
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_seq = batch.seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.stored(self._key, event)
            elif isinstance(event, BlockRemoved):
                index.removed(self._key, event)
            elif isinstance(event, AllBlocksCleared):
                self._reset(precise=True)  # the engine says exactly what it holds now: nothing
        if self.stats.rebuilding:
            capacity = self._owner.capacity_blocks(self._key)
            if capacity and index.stored_since_clear(self._key) >= capacity:
                self._mark_precise()

    def _reset(self, precise: bool) -> None:
        self._owner.index.clear(self._key)
        self._owner.index.set_precise(self._key, precise)
        if precise:
            self._mark_precise()
        else:
            self.stats.last_seq = None if not self.stats.connected else self.stats.last_seq

    def _mark_precise(self) -> None:
        if self.stats.rebuilding:
            log.info("kv events state rebuilt replica=%s", self._key)
        self.stats.rebuilding = False
        self._owner.index.set_precise(self._key, True)


class KvEventSubscriber:
    """Keeps one subscription per discovered replica that has an events address."""

    def __init__(self, index: PrecisePrefixIndex, addresses: KvEventAddresses,
                 replay_addresses: KvEventAddresses, topic: str = "kv-events", replay_timeout_s: float = 2.0,
                 bind: bool = False,
                 capacity_blocks: Callable[[str], int | None] = lambda key: None,
                 on_lost: Callable[[str], None] = lambda key: None) -> None:
        self.index = index
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.bind = bind
        self.capacity_blocks = capacity_blocks
        self.on_lost = on_lost
        self._addresses = addresses
        self._replay_addresses = replay_addresses
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._subscriptions: dict[str, _Subscription] = {}

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Subscribe to new replicas, drop those that left (their state is cleared)."""
        wanted = {e.key: (address, self._replay_addresses.address(e))
                  for e in endpoints if (address := self._addresses.address(e))}
        for key in list(self._tasks):
            if key not in wanted or wanted[key][0] != self._tasks[key][0]:
                self._drop(key)
        for key, (address, replay) in wanted.items():
            if key not in self._tasks:
                subscription = _Subscription(key, ReplicaEventStats(address, replay), self)
                self._subscriptions[key] = subscription
                task = asyncio.get_running_loop().create_task(subscription.run(), name=f"kv-events {key}")
                self._tasks[key] = (address, task)

    def stats(self) -> dict[str, ReplicaEventStats]:
        """Per replica key, what its subscription has seen."""
        return {key: subscription.stats for key, subscription in self._subscriptions.items()}

    async def close(self) -> None:
        """Stop every subscription."""
        tasks = [task for _, task in self._tasks.values()]
        for key in list(self._tasks):
            self._drop(key)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _drop(self, key: str) -> None:
        _, task = self._tasks.pop(key)
        task.cancel()
        self._subscriptions.pop(key, None)
        self.index.forget(key)
