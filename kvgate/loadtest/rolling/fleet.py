"""A fleet of simulated replicas with a pod's lifecycle, restarted one at a time in the order Kubernetes does,
while discovery reports each step."""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvgate.endpoints.discovery import DiscoveryStatus, EndpointsCallback
from kvgate.endpoints.types import Endpoint
from kvgate.simulator import SimOptions, SimReplica

log = logging.getLogger(__name__)
# After a drain nothing is in flight; this only bounds a stop that follows a drain timeout.
_STOP_GRACE_SECONDS = 1.0


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


# Called with every listed replica after each change, like a full EndpointSlice list.
Publisher = Callable[[Sequence[PublishedReplica]], None]


class ControlledDiscovery:
    """A Discovery whose endpoints are the replicas last published (accepting only while ready), reported at once."""

    def __init__(self) -> None:
        self.status = DiscoveryStatus(healthy=True, synced=True)
        self._endpoints: list[Endpoint] = []
        self._changed = asyncio.Event()

    def publish(self, replicas: Sequence[PublishedReplica]) -> None:
        """A Publisher: list `replicas` as endpoints."""
        self._endpoints = [Endpoint(key=r.name, url=r.url, accepting=r.phase is ReplicaPhase.READY) for r in replicas]
        self._changed.set()

    async def run(self, on_change: EndpointsCallback) -> None:
        """Report the current set, then every replacement, until cancelled."""
        while True:
            self._changed.clear()
            self.status.last_event_at = time.monotonic()
            on_change(list(self._endpoints))
            await self._changed.wait()


class RestartableReplica:
    """A SimReplica served on its own loopback port, stopped gracefully or killed like a pod."""

    def __init__(self, name: str, options: SimOptions) -> None:
        self.name = name
        self.sim = SimReplica(options)
        self.url = ""
        self._runner: web.AppRunner | None = None

    @classmethod
    async def start(cls, name: str, options: SimOptions) -> RestartableReplica:
        """Listen on a free port; the API answers once `options.startup_seconds` (model load) have passed."""
        replica = cls(name, options)
        replica._runner = web.AppRunner(replica.sim.build_app(), access_log=None, shutdown_timeout=_STOP_GRACE_SECONDS)
        await replica._runner.setup()
        try:
            await web.TCPSite(replica._runner, "127.0.0.1", 0).start()
        except BaseException:
            await replica.stop()
            raise
        replica.url = f"http://127.0.0.1:{replica._runner.addresses[0][1]}"
        log.info("replica started name=%s url=%s", name, replica.url)
        return replica

    def in_flight(self) -> int:
        """Sequences the engine holds now, running or waiting."""
        stats = self.sim.stats()
        return int(stats["running"] + stats["waiting"])

    async def stop(self) -> None:
        """Close the port, aborting whatever is still in flight (a pod's SIGKILL after its grace period)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            log.info("replica stopped name=%s", self.name)

    async def kill(self) -> None:
        """Die at once: every open connection dropped mid-response (nothing ends gracefully), then the port closed."""
        server = self._runner.server if self._runner is not None else None
        for connection in server.connections if server else ():
            if connection.transport is not None:
                connection.transport.abort()
        await self.stop()


async def start_replicas(count: int, options: SimOptions) -> list[RestartableReplica]:
    """Start `count` replicas named vllm-0, vllm-1, ...; stops those started if one fails."""
    replicas: list[RestartableReplica] = []
    try:
        for ordinal in range(count):
            replicas.append(await RestartableReplica.start(f"vllm-{ordinal}", options))
    except BaseException:
        await asyncio.gather(*(replica.stop() for replica in replicas))
        raise
    return replicas


@dataclass(frozen=True, slots=True)
class RestartTiming:
    """How long each step of a pod's replacement takes."""

    propagation_s: float = 0.1  # between discovery marking the pod not ready and the replica refusing work
    discovery_first: bool = True  # False: the replica refuses work `propagation_s` before discovery notices
    shutdown_timeout_s: float = 10.0  # vLLM --shutdown-timeout: in-flight requests get this long to finish
    removal_lag_s: float = 0.0  # between the port closing and discovery dropping the endpoint
    probe_interval_s: float = 0.05  # readiness probe period
    probe_timeout_s: float = 0.25
    ready_timeout_s: float = 10.0  # a replacement not ready by then fails the restart


@dataclass(frozen=True, slots=True)
class RestartRecord:
    """What happened to one replica's replacement; times are event loop clock values."""

    old: str
    new: str
    in_flight_at_shutdown: int  # sequences the old replica held when it stopped taking new work
    drained: bool  # all of them finished before the shutdown timeout
    aborted: int  # sequences the old replica aborted (cut streams)
    began: float
    stopped: float  # the old replica's port closed
    ready: float  # the replacement listed as ready


class RollingRestart:
    """Replaces the replicas of a fleet one at a time, publishing each phase through `publish`; `replicas` is the
    live list, its entries swapped for their replacements as the restart goes."""

    def __init__(self, replicas: Sequence[RestartableReplica], publish: Publisher,
                 replacement_options: SimOptions, timing: RestartTiming) -> None:
        self.replicas = list(replicas)
        self._publish = publish
        self._options = replacement_options
        self._timing = timing
        self._ordinals = itertools.count(len(self.replicas))
        self._listed = {r.name: PublishedReplica(r.name, r.url, ReplicaPhase.READY) for r in self.replicas}
        self._publish(list(self._listed.values()))

    async def restart_all(self) -> list[RestartRecord]:
        """Restart every replica in turn; the records of this pass."""
        return [await self.restart(index) for index in range(len(self.replicas))]

    async def restart(self, index: int) -> RestartRecord:
        """Terminate replica `index` gracefully (drain, then stop) and bring up its replacement."""
        timing, old = self._timing, self.replicas[index]
        began = asyncio.get_running_loop().time()
        if timing.discovery_first:
            self._list(old, ReplicaPhase.TERMINATING)
            await asyncio.sleep(timing.propagation_s)  # a preStop sleep: let every gateway see it first
        in_flight = old.in_flight()
        old.sim.begin_shutdown()
        if not timing.discovery_first:
            await asyncio.sleep(timing.propagation_s)  # the EndpointSlice update is late
            self._list(old, ReplicaPhase.TERMINATING)
        drained = await old.sim.drain(timing.shutdown_timeout_s)
        aborted = int(old.sim.stats()["aborts"])
        log.info("replica drained name=%s in_flight=%d drained=%s aborted=%d", old.name, in_flight, drained, aborted)
        await old.stop()
        return await self._replace(index, began, in_flight, drained, aborted)

    async def crash(self, index: int) -> RestartRecord:
        """Kill replica `index` while discovery still lists it ready, then bring up its replacement."""
        old = self.replicas[index]
        began, in_flight = asyncio.get_running_loop().time(), old.in_flight()
        await old.kill()
        aborted = int(old.sim.stats()["aborts"])
        log.info("replica killed name=%s in_flight=%d aborted=%d", old.name, in_flight, aborted)
        return await self._replace(index, began, in_flight, False, aborted)

    async def _replace(self, index: int, began: float, in_flight: int, drained: bool, aborted: int) -> RestartRecord:
        """After the old replica's port closed: drop it from discovery, start its replacement, list it ready."""
        loop = asyncio.get_running_loop()
        stopped, old = loop.time(), self.replicas[index]
        await asyncio.sleep(self._timing.removal_lag_s)
        del self._listed[old.name]
        log.info("discovery drops name=%s", old.name)
        self._publish(list(self._listed.values()))
        new = await RestartableReplica.start(f"vllm-{next(self._ordinals)}", self._options)
        self.replicas[index] = new
        self._list(new, ReplicaPhase.STARTING)
        await self._wait_ready(new)
        self._list(new, ReplicaPhase.READY)
        return RestartRecord(old.name, new.name, in_flight, drained, aborted, began, stopped, loop.time())

    async def _wait_ready(self, replica: RestartableReplica) -> None:
        """Probe /health like a kubelet readiness probe until it answers 200."""
        timing = self._timing
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timing.ready_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timing.probe_timeout_s)) as session:
            while loop.time() < deadline:
                try:
                    async with session.get(replica.url + "/health") as response:
                        if response.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass  # still loading: the probe times out, as against a vLLM that has not bound its API yet
                await asyncio.sleep(timing.probe_interval_s)
        raise RuntimeError(f"{replica.name} not ready within {timing.ready_timeout_s:g}s")

    def _list(self, replica: RestartableReplica, phase: ReplicaPhase) -> None:
        self._listed[replica.name] = PublishedReplica(replica.name, replica.url, phase)
        log.info("discovery lists name=%s phase=%s", replica.name, phase.value)
        self._publish(list(self._listed.values()))
