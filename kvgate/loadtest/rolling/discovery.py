"""What discovery says about each replica during a restart, and an in-process discovery source to say it."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgate.endpoints.discovery import DiscoveryStatus, EndpointsCallback
from kvgate.endpoints.types import Endpoint


class ReplicaPhase(enum.Enum):
    """A pod's state as the EndpointSlice controller publishes it."""

    STARTING = "starting"  # listed, readiness probe not passed yet: ready=false serving=false
    READY = "ready"  # ready=true serving=true: takes new requests
    TERMINATING = "terminating"  # deleted, still running: ready=false terminating=true


@dataclass(frozen=True, slots=True)
class PublishedReplica:
    """One replica as discovery lists it."""

    name: str
    url: str
    phase: ReplicaPhase

    def endpoint(self) -> Endpoint:
        """The endpoint the gateway sees: accepting only while ready."""
        return Endpoint(key=self.name, url=self.url, accepting=self.phase is ReplicaPhase.READY)


# Called with every listed replica after each change, like a full EndpointSlice list.
Publisher = Callable[[Sequence[PublishedReplica]], None]


class ControlledDiscovery:
    """A Discovery whose endpoint set the caller replaces with `set`; reported to the gateway at once."""

    def __init__(self, endpoints: Sequence[Endpoint] = ()) -> None:
        self.status = DiscoveryStatus(healthy=True, synced=True)
        self._endpoints = list(endpoints)
        self._changed = asyncio.Event()

    def set(self, endpoints: Sequence[Endpoint]) -> None:
        """Replace the endpoint set."""
        self._endpoints = list(endpoints)
        self._changed.set()

    def publish(self, replicas: Sequence[PublishedReplica]) -> None:
        """A Publisher: list `replicas` as endpoints."""
        self.set([replica.endpoint() for replica in replicas])

    async def run(self, on_change: EndpointsCallback) -> None:
        """Report the current set, then every replacement, until cancelled."""
        while True:
            self._changed.clear()
            self.status.last_event_at = time.monotonic()
            on_change(list(self._endpoints))
            await self._changed.wait()
