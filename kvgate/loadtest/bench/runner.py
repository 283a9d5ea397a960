"""Runs a benchmark: for each scenario a simulated fleet and an oracle replica sized for it, then every row in turn."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvgate.loadtest.bench.client import RequestSample
from kvgate.loadtest.bench.gateway_probe import read_decisions
from kvgate.loadtest.bench.processes import ProcessError, start_external, start_gateway, start_sim_fleet
from kvgate.loadtest.bench.results import BASELINE_POLICY, EXTERNAL, KVGATE, ORACLE, RowPlan, RowRun, ScenarioRun
from kvgate.loadtest.bench.scenarios import Scenario
from kvgate.loadtest.bench.sim_probe import LoadSampler, read_stats, reset_stats
from kvgate.loadtest.bench.sizing import fleet_options, oracle_options
from kvgate.simulator import SimOptions

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
_PROGRESS_INTERVAL_SECONDS = 5.0
FRONT_POLICY = "round-robin"  # the front that spreads a single-URL load generator over several gateways


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """Everything one benchmark run needs."""

    scenarios: tuple[Scenario, ...]
    replicas: int
    policies: tuple[str, ...]  # kvgate policies measured besides the round-robin baseline
    gateways: int  # gateways of the multi-gateway cache-aware row; below 2 leaves it out
    externals: tuple[tuple[str, str], ...]  # (row name, command line template)
    peer: str  # the external row the targets compare with
    cache_fraction: float
    sim: SimOptions  # timing knobs every simulated replica shares
    out_dir: Path

    def fleet_options(self, scenario: Scenario) -> SimOptions:
        """Settings of each fleet replica for a scenario."""
        return fleet_options(scenario.footprint(self.sim.block_size), scenario.model, self.sim, self.cache_fraction)

    def oracle_options(self, scenario: Scenario) -> SimOptions:
        """Settings of the oracle replica for a scenario."""
        return oracle_options(scenario.footprint(self.sim.block_size), scenario.model, self.sim)


def plan_rows(settings: BenchSettings) -> list[RowPlan]:
    """The rows of every scenario: oracle, baseline, each policy, several gateways, external routers."""
    rows = [RowPlan(ORACLE, ORACLE), RowPlan(BASELINE_POLICY, KVGATE, policy=BASELINE_POLICY)]
    rows += [RowPlan(policy, KVGATE, policy=policy) for policy in settings.policies if policy != BASELINE_POLICY]
    if settings.gateways > 1:
        rows.append(RowPlan(f"cache-aware x{settings.gateways}", KVGATE, policy="cache-aware",
                            gateways=settings.gateways))
    rows += [RowPlan(name, EXTERNAL, template=template) for name, template in settings.externals]
    return rows


async def run_bench(settings: BenchSettings, progress: Progress) -> list[ScenarioRun]:
    """Run every scenario's rows one at a time against one simulated fleet per scenario, reset between rows."""
    log_dir = settings.out_dir / "logs"
    plans = plan_rows(settings)
    scenarios: list[ScenarioRun] = []
    for scenario in settings.scenarios:
        run = ScenarioRun(scenario.name, scenario.describe(), scenario.parameters(), scenario.skewed,
                          settings.fleet_options(scenario), settings.oracle_options(scenario))
        async with AsyncExitStack() as stack:
            fleet, fleet_urls = await start_sim_fleet(f"{scenario.name}-fleet", settings.replicas, run.fleet, log_dir)
            stack.push_async_callback(fleet.stop)
            oracle, oracle_urls = await start_sim_fleet(f"{scenario.name}-oracle", 1, run.oracle, log_dir)
            stack.push_async_callback(oracle.stop)
            session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
            for plan in plans:
                sim_urls = oracle_urls if plan.kind == ORACLE else fleet_urls
                row = RowRun(plan)
                label = f"{scenario.name}/{plan.name}"
                try:
                    async with _routers(plan, fleet_urls, log_dir, scenario.name) as gateways:
                        await reset_stats(session, sim_urls)
                        async with _front(scenario, gateways, log_dir, label) as targets:
                            await _measure(row, session, sim_urls, targets or sim_urls, scenario,
                                           settings.out_dir / "runs" / label.replace(" ", ""), _Ticker(label, progress))
                        if plan.kind == KVGATE:
                            row.decisions = await read_decisions(session, gateways)
                except ProcessError as exc:
                    row.error = str(exc).splitlines()[0]
                    log.warning("bench row failed row=%s error=%s", label, exc)
                run.rows.append(row)
                progress(_row_line(label, row))
        scenarios.append(run)
    return scenarios


@asynccontextmanager
async def _routers(plan: RowPlan, workers: Sequence[str], log_dir: Path, scenario: str) -> AsyncIterator[list[str]]:
    """Start the row's router processes; yields their base URLs (none for the oracle: traffic goes direct)."""
    async with AsyncExitStack() as stack:
        urls: list[str] = []
        for index in range(plan.gateways if plan.kind != ORACLE else 0):
            name = f"{scenario}-{plan.name}-{index}".replace(" ", "")
            if plan.kind == KVGATE:
                assert plan.policy is not None
                child, url = await start_gateway(name, plan.policy, workers, log_dir)
            else:
                assert plan.template is not None
                child, url = await start_external(name, plan.template, workers, log_dir)
            stack.push_async_callback(child.stop)
            urls.append(url)
        yield urls


@asynccontextmanager
async def _front(scenario: Scenario, gateways: list[str], log_dir: Path, label: str) -> AsyncIterator[list[str]]:
    """The URLs the load goes to: the gateways, or a round-robin kvgate in front of them for a one-URL generator."""
    if len(gateways) < 2 or not scenario.single_target:
        yield gateways
        return
    child, url = await start_gateway(f"{label}-front".replace(" ", "").replace("/", "-"), FRONT_POLICY, gateways,
                                     log_dir)
    try:
        yield [url]
    finally:
        await child.stop()


async def _measure(
    row: RowRun,
    session: aiohttp.ClientSession,
    sim_urls: Sequence[str],
    targets: Sequence[str],
    scenario: Scenario,
    work_dir: Path,
    ticker: _Ticker,
) -> None:
    """Drive the scenario through `targets` while sampling the replicas' load; fill in `row`."""
    loop = asyncio.get_running_loop()
    async with LoadSampler(session, sim_urls) as sampler:
        start = loop.time()
        ticking = asyncio.create_task(ticker.run())
        try:
            row.samples = await scenario.drive(targets, work_dir, ticker.count)
        finally:
            ticking.cancel()
        row.wall_seconds = loop.time() - start
    row.load = sampler.series
    row.replica_stats = await read_stats(session, sim_urls)


class _Ticker:
    """Counts finished requests and prints a progress line periodically while a row runs."""

    def __init__(self, label: str, progress: Progress) -> None:
        self._label = label
        self._progress = progress
        self._requests = 0
        self._errors = 0

    def count(self, sample: RequestSample) -> None:
        """Note one finished request."""
        self._requests += 1
        self._errors += sample.error is not None

    async def run(self) -> None:
        """Print progress every few seconds until cancelled."""
        elapsed = 0.0
        while True:
            await asyncio.sleep(_PROGRESS_INTERVAL_SECONDS)
            elapsed += _PROGRESS_INTERVAL_SECONDS
            self._progress(f"  {self._label}: {elapsed:.0f}s, {self._requests} requests, {self._errors} errors")


def _row_line(label: str, row: RowRun) -> str:
    """The one-line outcome of a row."""
    if row.error is not None:
        return f"{label}: FAILED: {row.error}"
    hit_rate = "n/a" if row.hit_rate is None else f"{row.hit_rate:.1%}"
    return f"{label}: {len(row.samples)} requests in {row.wall_seconds:.1f}s, hit rate {hit_rate}, {row.errors} errors"
