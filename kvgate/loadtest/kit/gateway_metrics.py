"""Reading a kvgate gateway's own counters from its /metrics: what it decided during a benchmark run."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Collection, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

_DECISIONS = "kvgate_routing_decisions"


async def metric_samples(session: aiohttp.ClientSession, url: str, families: Collection[str]) -> list[Sample]:
    """The samples of the named metric families on the gateway at `url`."""
    async with session.get(url + "/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    return [sample for family in text_string_to_metric_families(text) if family.name in families
            for sample in family.samples]


async def read_decisions(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, int]:
    """Routing decisions by reason (prefix_hit, cold, overflow, ...), summed over the gateways at `urls`."""
    totals: Counter[str] = Counter()
    for samples in await asyncio.gather(*(metric_samples(session, url, {_DECISIONS}) for url in urls)):
        for sample in samples:
            if sample.name.endswith("_total"):
                totals[sample.labels["reason"]] += int(sample.value)
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
            if all(e["kv_events"] and e["kv_events"]["connected"] and (not precise or e["routing"] == "precise")
                   for e in endpoints):
                break
            if loop.time() > deadline:
                raise TimeoutError(f"{url}: KV events not {'precise' if precise else 'connected'} in {timeout:.0f}s")
            await asyncio.sleep(0.05)
