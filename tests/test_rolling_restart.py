"""A rolling restart of the vLLM fleet under steady streaming load fails no request.

The fleet is published as EndpointSlices in a test API server, with the conditions the EndpointSlice
controller sets, and the gateway runs with `--discovery kubernetes`: every step reaches it the way
it does in a cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import orjson
import pytest

from kvgate.loadtest.kit.stream import RequestSample
from kvgate.loadtest.rolling.fleet import RestartTiming, RollingRestart, start_replicas
from kvgate.loadtest.rolling.scenario import SCENARIOS, SteadyLoad, retries_by_cause
from kvgate.simulator import SimOptions
from tests.bench_run import run_bench
from tests.harness import RunningGateway, running_gateway, wait_until
from tests.k8s_api import K8sTestApi
from tests.k8s_fleet import SlicePublisher

pytestmark = pytest.mark.timeout(30)

OPTIONS = SimOptions(speed=4.0, max_model_len=4096)
MODEL = OPTIONS.models[0]
# Replacements load their model for 0.3 s: the port is open but nothing answers, as with vLLM.
REPLACEMENT = dataclasses.replace(OPTIONS, startup_seconds=0.3 * OPTIONS.speed)
REPLICAS = 3
CLIENTS = 24
MAX_TOKENS = 32  # a stream takes about 0.15 s

T = TypeVar("T")


@asynccontextmanager
async def restartable_fleet(api: K8sTestApi, timing: RestartTiming
                            ) -> AsyncIterator[tuple[RunningGateway, RollingRestart, SlicePublisher]]:
    """Three replicas listed as EndpointSlices, a gateway watching them, and the driver that restarts them."""
    replicas = await start_replicas(REPLICAS, OPTIONS)
    publisher = SlicePublisher(api)
    restart = RollingRestart(replicas, publisher, REPLACEMENT, timing)
    try:
        async with running_gateway(discovery="kubernetes", service=[publisher.service], port_name="http") as gw:
            await wait_until(lambda: gw.gateway.fleet is not None and gw.gateway.fleet.routable_count() == REPLICAS)
            yield gw, restart, publisher
    finally:
        for replica in restart.replicas:
            await replica.stop()


async def under_load(gw: RunningGateway, action: Callable[[], Awaitable[T]], max_tokens: int = MAX_TOKENS
                     ) -> tuple[T, list[RequestSample], float]:
    """Run `action` while CLIENTS stream through the gateway; its result, every sample, and the load's start time."""
    load = SteadyLoad(gw.url, MODEL, CLIENTS, max_requests=3000, max_seconds=20.0, max_tokens=max_tokens)
    running = asyncio.create_task(load.run())
    try:
        await wait_until(lambda: len(load.samples) >= CLIENTS, timeout=10.0)  # steady state: every client streams
        result = await action()
        await asyncio.sleep(0.5)  # load goes on over the replaced fleet
    finally:
        load.stop()
        samples = await running
    return result, samples, load.run_start


def failed(samples: list[RequestSample]) -> list[RequestSample]:
    """Requests that did not end in a complete stream (non-200, error event, or no [DONE])."""
    return [s for s in samples if s.error is not None or s.output_chunks == 0]


async def test_rolling_restart_under_streaming_load_fails_no_request(api):
    # A preStop sleep of 0.4 s, far longer than the watch takes to reach the gateway here, even with the suite
    # loading both cores (at 0.2 s a request reached a draining replica once in such a run); streams of about
    # 0.9 s, so each replica still has streams open when it begins its own shutdown.
    async with restartable_fleet(api, RestartTiming(propagation_s=0.4)) as (gw, restart, publisher):
        originals = [r.name for r in restart.replicas]
        records, samples, start = await under_load(gw, restart.restart_all, max_tokens=6 * MAX_TOKENS)
        fleet = gw.gateway.fleet
        assert {e.key: e.accepting for e in fleet.endpoints} == {publisher.key(r.name): True for r in restart.replicas}
        moved = retries_by_cause(gw.gateway)

    assert failed(samples) == []
    during = [s for s in samples if records[0].began <= start + s.start <= records[-1].ready]
    assert len(samples) >= 80 and len(during) >= 40
    assert [r.old for r in records] == originals
    assert not {r.new for r in records} & set(originals)  # every replica was replaced, each listed ready (above)
    # Streams open on each replica when it began shutting down ran to completion on it.
    assert all(r.drained and r.aborted == 0 for r in records), records
    assert sum(r.in_flight_at_shutdown for r in records) >= REPLICAS
    assert sum(moved.values()) == 0, moved  # discovery was ahead: no request even reached a draining replica


async def test_replica_shutting_down_before_discovery_notices_has_its_requests_retried(api):
    lagging = RestartTiming(propagation_s=0.2, discovery_first=False)
    async with restartable_fleet(api, lagging) as (gw, restart, _):
        records, samples, _ = await under_load(gw, restart.restart_all)
        moved = retries_by_cause(gw.gateway)

    assert failed(samples) == []
    assert len(samples) >= 100
    assert moved.get("replica_shutdown", 0) > 0, moved  # requests that met vLLM's shutdown 503 went elsewhere
    assert all(r.drained and r.aborted == 0 for r in records), records


async def test_killed_replica_still_listed_fails_no_new_request(api):
    # Discovery notices the dead pod only after its liveness probe fails: it stays listed ready meanwhile.
    listed_after_death = 0.5
    async with restartable_fleet(api, RestartTiming(removal_lag_s=listed_after_death)) as (gw, restart, publisher):
        victim = restart.replicas[0]
        open_on_victim: list[int] = []

        async def kill() -> float:
            open_on_victim.append(gw.gateway.fleet.in_flight(publisher.key(victim.name)))
            killed_at = asyncio.get_running_loop().time()
            await restart.crash(0)
            return killed_at

        killed_at, samples, start = await under_load(gw, kill)
        moved = retries_by_cause(gw.gateway)

    cut = failed(samples)
    later = [s for s in samples if start + s.start >= killed_at]
    while_listed = sum(1 for s in later if start + s.start < killed_at + listed_after_death)
    assert len(later) >= CLIENTS and failed(later) == [], (while_listed, moved)  # nothing sent after the kill failed
    # Only streams open on the dead replica may fail, each with an error event rather than a hang.
    assert all(start + s.start < killed_at < start + s.start + s.e2e for s in cut)
    assert len(cut) <= open_on_victim[0], (len(cut), open_on_victim)
    assert all(s.error.startswith("stream error") for s in cut), [s.error for s in cut]


def test_rolling_scenario_reports_both_orders_and_fails_no_request(tmp_path) -> None:
    done = run_bench("rolling", "--quick", "--out", str(tmp_path), "--docs", str(tmp_path / "docs.md"), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = orjson.loads((tmp_path / "rolling.json").read_bytes())
    assert [s["title"] for s in report["scenarios"]] == [s.title for s in SCENARIOS]
    for scenario in report["scenarios"]:
        assert scenario["requests"] > 0 and scenario["failed"] == 0
        began, ended = scenario["restart_window"]
        assert 0 < began < ended
    assert "| discovery first" in (tmp_path / "docs.md").read_text()
