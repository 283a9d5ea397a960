"""What a benchmark reads while it runs: a gateway's own metrics, the replicas' counters, samples over time."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

_DECISIONS = "kvgate_routing_decisions"
_OVERFLOWS = "kvgate_routing_overflows"


async def metric_samples(session: aiohttp.ClientSession, url: str, families: Collection[str]) -> list[Sample]:
    """The samples of the named metric families on the gateway at `url`."""
    async with session.get(url + "/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    return [sample for family in text_string_to_metric_families(text) if family.name in families
            for sample in family.samples]


async def read_decisions(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, int]:
    """Routing decisions by reason (prefix_hit, cold, overflow, ...) and overflows by what moved them ("overflow by
    cost", "overflow by recent-share", ...), summed over the gateways at `urls`."""
    totals: Counter[str] = Counter()
    for samples in await asyncio.gather(*(metric_samples(session, url, {_DECISIONS, _OVERFLOWS}) for url in urls)):
        for sample in samples:
            if sample.name == _DECISIONS + "_total":
                totals[sample.labels["reason"]] += int(sample.value)
            elif sample.name == _OVERFLOWS + "_total":
                totals["overflow by " + sample.labels["moved_by"]] += int(sample.value)
    return dict(totals)


async def wait_kv_events(session: aiohttp.ClientSession, urls: Sequence[str], precise: bool,
                         timeout: float = 60.0) -> None:
    """Wait until every gateway at `urls` is connected to every replica's KV events, and with `precise` until it
    routes every replica on them (its replays are over and it has seen the reset's AllBlocksCleared)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for url in urls:
        while True:
            async with session.get(url + "/debug/fleet") as response:
                endpoints = (await response.json())["endpoints"]
            waiting = [e for e in endpoints if not (e["kv_events"] and e["kv_events"]["connected"]
                                                    and (not precise or e["routing"] == "precise"))]
            if not waiting:
                break
            if loop.time() > deadline:
                raise TimeoutError(f"{url}: KV events not {'precise' if precise else 'connected'} in {timeout:.0f}s: "
                                   + "; ".join(f"{e['url']} routing={e['routing']} events={e['kv_events']}"
                                               for e in waiting))
            await asyncio.sleep(0.05)


SAMPLE_INTERVAL_SECONDS = 0.5


async def _call_all(session: aiohttp.ClientSession, method: str, urls: Sequence[str], path: str) -> list[dict[str, Any]]:
    async def call(url: str) -> dict[str, Any]:
        async with session.request(method, url + path) as response:
            response.raise_for_status()
            return await response.json()

    return list(await asyncio.gather(*(call(url) for url in urls)))


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

    async def stats(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
        """Counters since the reset and queues now, per replica, with /sim/stats' names."""


class SimProbe:
    """The simulator's exact counters: `POST /sim/reset` and `GET /sim/stats` on every replica."""

    async def reset(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
        """Zero every replica's counters and clear its prefix cache."""
        await _call_all(session, "POST", urls, "/sim/reset")

    async def stats(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
        """Every replica's `/sim/stats`, in the order of `urls`."""
        return await _call_all(session, "GET", urls, "/sim/stats")


async def reset_for_row(session: aiohttp.ClientSession, probe: ReplicaProbe, replica_urls: Sequence[str],
                        gateway_urls: Sequence[str], precise: bool) -> None:
    """Reset the replicas before a row; with `precise`, only once every gateway follows their KV events (so it sees
    the reset's AllBlocksCleared), and return once every gateway routes every replica on them again."""
    if precise:
        await wait_kv_events(session, gateway_urls, precise=False)
    await probe.reset(session, replica_urls)
    if precise:
        await wait_kv_events(session, gateway_urls, precise=True)


# Counter samples on the page -> the stats keys the benchmark reads (the simulator's /sim/stats names).
_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:request_success_total": "requests",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "preemptions",
}
_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv_cache_usage"}


def _page_stats(page: str) -> dict[str, float]:
    """The benchmark's counters and gauges from one /metrics page, summed over label sets."""
    stats = dict.fromkeys([*_COUNTERS.values(), *_GAUGES.values()], 0.0)
    names = _COUNTERS | _GAUGES
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in names:
                stats[names[sample.name]] += sample.value
    return stats


class VllmProbe:
    """Reads and resets engines the way the simulator's /sim/stats and /sim/reset do, from vLLM's own endpoints."""

    def __init__(self) -> None:
        self._baseline: dict[str, dict[str, float]] = {}

    async def _page(self, session: aiohttp.ClientSession, url: str) -> dict[str, float]:
        async with session.get(url + "/metrics") as response:
            response.raise_for_status()
            return _page_stats(await response.text())

    async def reset(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
        """Empty every engine's prefix cache and count from here (vLLM's counters never go back to zero)."""
        for url in urls:
            async with session.post(url + "/reset_prefix_cache") as response:
                response.raise_for_status()
            self._baseline[url] = await self._page(session, url)

    async def stats(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, Any]]:
        """Counters since the last reset, and the queues now, per engine in the order of `urls`."""
        pages = await asyncio.gather(*(self._page(session, url) for url in urls))
        result = []
        for url, page in zip(urls, pages, strict=True):
            baseline = self._baseline.get(url, {})
            counters = {key: page[key] - baseline.get(key, 0.0) for key in _COUNTERS.values()}
            result.append(counters | {key: page[key] for key in _GAUGES.values()})
        return result


@asynccontextmanager
async def sampling(interval: float, sample: Callable[[], Awaitable[object]]) -> AsyncIterator[None]:
    """Await `sample()` every `interval` seconds while the block runs; one that fails on I/O is skipped."""

    async def every_interval() -> None:
        while True:
            with suppress(aiohttp.ClientError, TimeoutError):  # a missed sample leaves a gap in the plot
                await sample()
            await asyncio.sleep(interval)

    task = asyncio.create_task(every_interval())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@dataclass(slots=True)
class LoadSeries:
    """Requests on each replica (running + waiting) sampled over a run."""

    times: list[float] = field(default_factory=list)  # seconds since the sampler started
    per_replica: list[list[int]] = field(default_factory=list)  # [replica][sample]


@asynccontextmanager
async def sampling_load(session: aiohttp.ClientSession, urls: Sequence[str],
                        probe: ReplicaProbe) -> AsyncIterator[LoadSeries]:
    """Every replica's running + waiting sequences, sampled at a fixed interval while the block runs."""
    series = LoadSeries(per_replica=[[] for _ in urls])
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def sample() -> None:
        stats = await probe.stats(session, urls)
        series.times.append(loop.time() - start)
        for load, replica in zip(series.per_replica, stats, strict=True):
            load.append(int(replica["running"]) + int(replica["waiting"]))

    async with sampling(SAMPLE_INTERVAL_SECONDS, sample):
        yield series
