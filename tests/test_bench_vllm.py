"""The routing benchmark's real-engine mode, without an engine: its probe reads vLLM's own page and reset."""

from __future__ import annotations

from aiohttp import web

from kvgate.loadtest.kit.counters import VllmProbe
from kvgate.loadtest.routing.vllm_fleet import BLOCK_SIZE, EngineSizing
from kvgate.loadtest.routing.workload import WorkloadSpec
from tests.harness import scripted_replica
from tests.metrics_shape import REAL_PAGE

HITS = 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"}'
QUERIES = 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"}'


def with_counters(page: str, hits: float, queries: float) -> str:
    """The page with its prefix-cache counters set."""
    lines = [f"{HITS} {hits}" if line.startswith(HITS) else f"{QUERIES} {queries}" if line.startswith(QUERIES)
             else line for line in page.splitlines()]
    return "\n".join(lines) + "\n"


async def test_probe_counts_from_the_reset_and_reads_queues_from_a_real_page(session):
    real = REAL_PAGE.read_text()
    page = {"text": with_counters(real, 100, 400)}
    resets = []

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page["text"], content_type="text/plain")

    async def reset(request: web.Request) -> web.Response:
        resets.append(request.path)
        return web.Response()

    async with scripted_replica([("GET", "/metrics", metrics), ("POST", "/reset_prefix_cache", reset)]) as url:
        probe = VllmProbe()
        await probe.reset(session, [url])
        page["text"] = with_counters(real, 250, 700)
        [stats] = await probe.stats(session, [url])
    assert resets == ["/reset_prefix_cache"]
    assert (stats["prefix_cache_hits"], stats["prefix_cache_queries"]) == (150.0, 300.0)
    assert (stats["running"], stats["waiting"]) == (2.0, 0.0)  # the gauges as captured, not deltas
    assert "evictions" not in stats  # vLLM does not count them: the report shows none rather than a made-up 0


def test_engine_caches_hold_the_asked_share_of_the_prefixes_in_play():
    spec = WorkloadSpec(tenants=16, system_prompt_chars=2000, conversations=160, concurrency=6)
    half, quarter = EngineSizing.of(spec, 0.5, 3.3), EngineSizing.of(spec, 0.25, 3.3)
    assert half.fleet_blocks >= 2 * quarter.fleet_blocks - 1
    assert half.oracle_blocks > 4 * half.fleet_blocks  # the oracle never evicts
    assert half.max_model_len % BLOCK_SIZE == 0 and half.max_model_len * 3.3 > 2000
