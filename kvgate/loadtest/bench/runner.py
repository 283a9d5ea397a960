"""Runs a benchmark: one simulated fleet and one oracle replica, then every row of every scenario in turn."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvgate.loadtest.bench.client import ConversationDriver, RequestSample
from kvgate.loadtest.bench.gateway_probe import read_decisions, wait_kv_events
from kvgate.loadtest.bench.processes import (
    ProcessError,
    precise_args,
    start_external,
    start_gateway,
    start_sim_fleet,
)
from kvgate.loadtest.bench.results import (
    BASELINE_POLICY,
    EXTERNAL,
    KVGATE,
    ORACLE,
    PRESSURE_ORACLE,
    RowPlan,
    RowRun,
    ScenarioRun,
)
from kvgate.loadtest.bench.sim_probe import LoadSampler, ReplicaProbe, SimProbe
from kvgate.loadtest.bench.sizing import fleet_options, oracle_options, pressure_oracle_options
from kvgate.loadtest.bench.vllm_fleet import VllmProbe, vllm_fleet
from kvgate.loadtest.bench.workload import Conversation, WorkloadSpec, build_conversations
from kvgate.simulator import SimOptions

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
_PROGRESS_INTERVAL_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """Everything one benchmark run needs."""

    workload: WorkloadSpec
    skews: tuple[str, ...]
    replicas: int
    policies: tuple[str, ...]  # kvgate policies measured besides the round-robin baseline
    gateways: int  # gateways of the multi-gateway cache-aware row; below 2 leaves it out
    externals: tuple[tuple[str, str], ...]  # (row name, command line template)
    cache_fraction: float
    sim: SimOptions  # timing knobs every simulated replica shares
    out_dir: Path
    vllm_python: str | None = None  # real vLLM engines (this interpreter has vLLM) instead of simulated replicas
    # Precise routing rows (simulated replicas): they tokenize with this model directory and publish KV events.
    tokenizer_dir: Path | None = None

    @property
    def chars_per_token(self) -> float:
        """For sizing: the simulator's own 4, or a conservative 3 for a real (byte-level BPE) tokenizer."""
        return 3.0 if self.tokenizer_dir else 4.0

    def fleet_options(self) -> SimOptions:
        """Settings of each fleet replica (publishing KV events in precise mode)."""
        options = fleet_options(self.workload, self.sim, self.cache_fraction, self.chars_per_token)
        if self.tokenizer_dir is None:
            return options
        return dataclasses.replace(options, tokenizer=str(self.tokenizer_dir), kv_events=True)

    def oracle_options(self) -> SimOptions:
        """Settings of the oracle replica."""
        options = oracle_options(self.workload, self.sim, self.chars_per_token)
        return dataclasses.replace(options, tokenizer=str(self.tokenizer_dir)) if self.tokenizer_dir else options

    def pressure_oracle_options(self) -> SimOptions:
        """Settings of the pressure oracle: one replica with the whole fleet's cache."""
        return pressure_oracle_options(self.fleet_options(), self.replicas)


def plan_rows(settings: BenchSettings) -> list[RowPlan]:
    """The rows of every scenario: oracle, baseline, each policy, several gateways, external routers."""
    rows = [RowPlan(ORACLE, ORACLE), RowPlan(BASELINE_POLICY, KVGATE, policy=BASELINE_POLICY)]
    rows += [RowPlan(policy, KVGATE, policy=policy) for policy in settings.policies if policy != BASELINE_POLICY]
    if settings.gateways > 1:
        rows.append(RowPlan(f"cache-aware x{settings.gateways}", KVGATE, policy="cache-aware",
                            gateways=settings.gateways))
    if settings.tokenizer_dir is not None:
        rows.insert(1, RowPlan(PRESSURE_ORACLE, PRESSURE_ORACLE))
        rows.append(RowPlan("cache-aware precise", KVGATE, policy="cache-aware", precise=True))
        if settings.gateways > 1:
            rows.append(RowPlan(f"cache-aware precise x{settings.gateways}", KVGATE, policy="cache-aware",
                                gateways=settings.gateways, precise=True))
    rows += [RowPlan(name, EXTERNAL, template=template) for name, template in settings.externals]
    return rows


async def run_bench(settings: BenchSettings, progress: Progress) -> list[ScenarioRun]:
    """Run every scenario's rows one at a time against the same simulated replicas, reset between rows."""
    log_dir = settings.out_dir / "logs"
    plans = plan_rows(settings)
    scenarios: list[ScenarioRun] = []
    async with AsyncExitStack() as stack:
        fleet_urls, direct, probe = await stack.enter_async_context(_replicas(settings, log_dir))
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
        for skew in settings.skews:
            spec = settings.workload.with_skew(skew)
            scenario = ScenarioRun(spec)
            conversations = build_conversations(spec)
            for plan in plans:
                sim_urls = direct.get(plan.kind, fleet_urls)
                row = RowRun(plan)
                try:
                    async with _routers(plan, fleet_urls, log_dir, skew, settings) as targets:
                        if plan.precise:
                            await wait_kv_events(session, targets, precise=False)  # so the reset is seen
                        await probe.reset(session, sim_urls)
                        if plan.precise:
                            await wait_kv_events(session, targets, precise=True)
                        await _measure(row, session, sim_urls, targets or sim_urls, spec, conversations, probe,
                                       _Ticker(f"{skew}/{plan.name}", progress))
                        if plan.kind == KVGATE:
                            row.decisions = await read_decisions(session, targets)
                except ProcessError as exc:
                    row.error = str(exc).splitlines()[0]
                    log.warning("bench row failed row=%s/%s error=%s", skew, plan.name, exc)
                scenario.rows.append(row)
                progress(_row_line(skew, row))
            scenarios.append(scenario)
    return scenarios


@asynccontextmanager
async def _replicas(settings: BenchSettings,
                    log_dir: Path) -> AsyncIterator[tuple[list[str], dict[str, list[str]], ReplicaProbe]]:
    """The fleet's URLs, the oracles' (by row kind), and how to read them: simulated replicas, or real engines."""
    if settings.vllm_python is not None:
        async with vllm_fleet(settings.workload, settings.replicas, settings.cache_fraction, settings.vllm_python,
                              settings.out_dir / "vllm") as (fleet_urls, oracle_urls, _):
            yield fleet_urls, {ORACLE: oracle_urls}, VllmProbe()
        return
    async with AsyncExitStack() as stack:
        fleet, fleet_urls = await start_sim_fleet("sim-fleet", settings.replicas, settings.fleet_options(), log_dir)
        stack.push_async_callback(fleet.stop)
        oracle, oracle_urls = await start_sim_fleet("sim-oracle", 1, settings.oracle_options(), log_dir)
        stack.push_async_callback(oracle.stop)
        direct = {ORACLE: oracle_urls}  # rows whose traffic goes straight to their own replica
        if settings.tokenizer_dir is not None:
            pressure, direct[PRESSURE_ORACLE] = await start_sim_fleet(
                "sim-pressure-oracle", 1, settings.pressure_oracle_options(), log_dir)
            stack.push_async_callback(pressure.stop)
        yield fleet_urls, direct, SimProbe()


@asynccontextmanager
async def _routers(plan: RowPlan, workers: Sequence[str], log_dir: Path, skew: str,
                   settings: BenchSettings) -> AsyncIterator[list[str]]:
    """Start the row's router processes; yields their base URLs (none for the oracles: traffic goes direct)."""
    async with AsyncExitStack() as stack:
        urls: list[str] = []
        extra = precise_args(workers, settings.fleet_options(), settings.tokenizer_dir) \
            if plan.precise and settings.tokenizer_dir else []
        for index in range(plan.gateways if plan.kind in (KVGATE, EXTERNAL) else 0):
            name = f"{skew}-{plan.name}-{index}".replace(" ", "")
            if plan.kind == KVGATE:
                assert plan.policy is not None
                child, url = await start_gateway(name, plan.policy, workers, log_dir, extra)
            else:
                assert plan.template is not None
                child, url = await start_external(name, plan.template, workers, log_dir)
            stack.push_async_callback(child.stop)
            urls.append(url)
        yield urls


async def _measure(
    row: RowRun,
    session: aiohttp.ClientSession,
    sim_urls: Sequence[str],
    targets: Sequence[str],
    spec: WorkloadSpec,
    conversations: Sequence[Conversation],
    probe: ReplicaProbe,
    ticker: _Ticker,
) -> None:
    """Drive the workload through `targets` while sampling the replicas' load; fill in `row`."""
    loop = asyncio.get_running_loop()
    driver = ConversationDriver(spec, targets, on_sample=ticker.count)
    async with LoadSampler(session, sim_urls, probe) as sampler:
        start = loop.time()
        ticking = asyncio.create_task(ticker.run())
        try:
            row.samples = await driver.run(conversations)
        finally:
            ticking.cancel()
        row.wall_seconds = loop.time() - start
    row.load = sampler.series
    row.replica_stats = await probe.stats(session, sim_urls)


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


def _row_line(skew: str, row: RowRun) -> str:
    """The one-line outcome of a row."""
    label = f"{skew}/{row.plan.name}"
    if row.error is not None:
        return f"{label}: FAILED: {row.error}"
    hit_rate = "n/a" if row.hit_rate is None else f"{row.hit_rate:.1%}"
    return f"{label}: {len(row.samples)} requests in {row.wall_seconds:.1f}s, hit rate {hit_rate}, {row.errors} errors"
