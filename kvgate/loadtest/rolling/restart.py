"""Restarting replicas one at a time in the order Kubernetes does, while discovery reports each step."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvgate.loadtest.rolling.discovery import PublishedReplica, Publisher, ReplicaPhase
from kvgate.loadtest.rolling.replica import RestartableReplica, replica_name
from kvgate.simulator import SimOptions

log = logging.getLogger(__name__)


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


class ReplicaNotReady(RuntimeError):
    """A replacement replica did not pass its readiness probe in time."""


class RollingRestart:
    """Replaces the replicas of a fleet one at a time, publishing each phase through `publish`.

    `replicas` is the live list: entries are swapped for their replacements as the restart goes.
    """

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
        loop = asyncio.get_running_loop()
        began = loop.time()
        if timing.discovery_first:
            self._list(old, ReplicaPhase.TERMINATING)
            await asyncio.sleep(timing.propagation_s)  # a preStop sleep: let every gateway see it first
            in_flight = old.in_flight()
            old.sim.begin_shutdown()
        else:
            in_flight = old.in_flight()
            old.sim.begin_shutdown()
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
        began = asyncio.get_running_loop().time()
        in_flight = old.in_flight()
        await old.kill()
        aborted = int(old.sim.stats()["aborts"])
        log.info("replica killed name=%s in_flight=%d aborted=%d", old.name, in_flight, aborted)
        return await self._replace(index, began, in_flight, False, aborted)

    async def _replace(self, index: int, began: float, in_flight: int, drained: bool, aborted: int) -> RestartRecord:
        """After the old replica's port closed: drop it from discovery, start its replacement, list it ready."""
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        old = self.replicas[index]
        await asyncio.sleep(self._timing.removal_lag_s)
        self._unlist(old)
        new = await RestartableReplica.start(replica_name(next(self._ordinals)), self._options)
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
        probe_timeout = aiohttp.ClientTimeout(total=timing.probe_timeout_s)
        async with aiohttp.ClientSession(timeout=probe_timeout) as session:
            while loop.time() < deadline:
                try:
                    async with session.get(replica.url + "/health") as response:
                        if response.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass  # still loading: the probe times out, as against a vLLM that has not bound its API yet
                await asyncio.sleep(timing.probe_interval_s)
        raise ReplicaNotReady(f"{replica.name} not ready within {timing.ready_timeout_s:g}s")

    def _list(self, replica: RestartableReplica, phase: ReplicaPhase) -> None:
        self._listed[replica.name] = PublishedReplica(replica.name, replica.url, phase)
        log.info("discovery lists name=%s phase=%s", replica.name, phase.value)
        self._publish(list(self._listed.values()))

    def _unlist(self, replica: RestartableReplica) -> None:
        del self._listed[replica.name]
        log.info("discovery drops name=%s", replica.name)
        self._publish(list(self._listed.values()))
