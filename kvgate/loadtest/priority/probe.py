"""Samples where requests wait during a run: the replicas' own queues, kvgate's queue, and stale scrapes."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from kvgate.loadtest.kit.replicas import read_stats

SAMPLE_INTERVAL_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class QueueSummary:
    """Queue depths seen while the load was on."""

    samples: int
    replica_waiting_mean: float  # per replica, from /sim/stats (ground truth)
    replica_waiting_max: int
    gateway_queue_max: int  # kvgate's admission queue, all classes
    stale_fraction: float  # of (sample, replica) pairs kvgate judged on stale metrics (headroom then counts only what was sent since the last good scrape)


@dataclass(slots=True)
class QueueProbe:
    """Polls /sim/stats of every replica and kvgate's /debug/fleet until stopped."""

    gateway_url: str
    replica_urls: Sequence[str]
    waiting: list[int] = field(default_factory=list)
    gateway_queue: list[int] = field(default_factory=list)
    stale: list[bool] = field(default_factory=list)

    async def run(self) -> None:
        """Sample until cancelled; a failed sample is skipped, not fatal."""
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    stats = await read_stats(session, self.replica_urls)
                    async with session.get(self.gateway_url + "/debug/fleet") as response:
                        fleet = await response.json()
                except (aiohttp.ClientError, TimeoutError):
                    stats = None
                if stats is not None:
                    self.waiting += [int(replica["waiting"]) for replica in stats]
                    self.gateway_queue.append(int(fleet["queue"]["waiting"]))
                    self.stale += [bool(endpoint["metrics"]["stale"]) for endpoint in fleet["endpoints"]]
                await asyncio.sleep(SAMPLE_INTERVAL_SECONDS)

    def summary(self) -> QueueSummary:
        """What the samples show."""
        return QueueSummary(
            len(self.gateway_queue),
            round(statistics.fmean(self.waiting), 1) if self.waiting else 0.0,
            max(self.waiting, default=0),
            max(self.gateway_queue, default=0),
            round(sum(self.stale) / len(self.stale), 3) if self.stale else 0.0,
        )
