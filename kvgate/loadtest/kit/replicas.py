"""Reading and resetting the replicas' counters (the simulator's exact ones, or a probe's), and sampling load over time."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

SAMPLE_INTERVAL_SECONDS = 0.5


async def _call_all(session: aiohttp.ClientSession, method: str, urls: Sequence[str], path: str) -> list[dict[str, Any]]:
    async def call(url: str) -> dict[str, Any]:
        async with session.request(method, url + path) as response:
            response.raise_for_status()
            return await response.json()

    return list(await asyncio.gather(*(call(url) for url in urls)))


async def reset_stats(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Zero every replica's counters and clear its prefix cache (`POST /sim/reset`)."""
    await _call_all(session, "POST", urls, "/sim/reset")


async def read_stats(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
    """Every replica's `/sim/stats`, in the order of `urls`."""
    return await _call_all(session, "GET", urls, "/sim/stats")


@dataclass(frozen=True, slots=True)
class RunningFleet:
    """Started replicas: the fleet's URLs, the oracles' by row kind, and kvgate's flags to route on their KV events."""

    urls: list[str]
    direct: dict[str, list[str]]
    precise_flags: list[str]


class ReplicaProbe(Protocol):
    """How the benchmark resets and reads its replicas: simulated ones (/sim/...) or real engines (their /metrics)."""

    async def reset(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
        """Zero the counters and empty the prefix caches."""
        ...

    async def stats(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
        """Counters since the reset and queues now, per replica, with /sim/stats' names."""
        ...


class SimProbe:
    """The simulator's exact counters."""

    async def reset(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
        """`POST /sim/reset` on every replica."""
        await reset_stats(session, urls)

    async def stats(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
        """Every replica's `/sim/stats`."""
        return await read_stats(session, urls)


@dataclass(slots=True)
class LoadSeries:
    """Requests on each replica (running + waiting) sampled over a run."""

    times: list[float] = field(default_factory=list)  # seconds since the sampler started
    per_replica: list[list[int]] = field(default_factory=list)  # [replica][sample]


class LoadSampler:
    """Samples every replica's running + waiting sequences at a fixed interval while it runs."""

    def __init__(self, session: aiohttp.ClientSession, urls: Sequence[str], probe: ReplicaProbe) -> None:
        self._session = session
        self._urls = list(urls)
        self._probe = probe
        self.series = LoadSeries(per_replica=[[] for _ in self._urls])
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoadSampler:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            try:
                stats = await self._probe.stats(self._session, self._urls)
            except (aiohttp.ClientError, TimeoutError):
                stats = None  # a missed sample leaves a gap in the plot, not a failed benchmark
            if stats is not None:
                self.series.times.append(loop.time() - start)
                for load, replica in zip(self.series.per_replica, stats, strict=True):
                    load.append(int(replica["running"]) + int(replica["waiting"]))
            await asyncio.sleep(SAMPLE_INTERVAL_SECONDS)
