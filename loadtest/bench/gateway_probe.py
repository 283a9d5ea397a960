"""Reading what kvgate gateways decided during a row: their routing decisions by reason, from /metrics."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_DECISIONS = "kvgate_routing_decisions"


async def read_decisions(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, int]:
    """Routing decisions by reason (prefix_hit, cold, overflow, ...), summed over the gateways at `urls`."""
    async def page(url: str) -> str:
        async with session.get(url + "/metrics") as response:
            response.raise_for_status()
            return await response.text()

    totals: Counter[str] = Counter()
    for text in await asyncio.gather(*(page(url) for url in urls)):
        for family in text_string_to_metric_families(text):
            if family.name == _DECISIONS:
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals[sample.labels["reason"]] += int(sample.value)
    return dict(totals)
