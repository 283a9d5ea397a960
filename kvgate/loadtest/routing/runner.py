"""Runs a routing benchmark: per load a fleet and oracle sized for it, then every row in turn, `runs` times each."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvgate.loadtest.kit.counters import (
    ReplicaProbe,
    RunningFleet,
    SimProbe,
    VllmProbe,
    read_decisions,
    reset_for_row,
    sampling,
    sampling_load,
)
from kvgate.loadtest.kit.processes import (
    ProcessError,
    peer_flags,
    running,
    start_external,
    start_gateway,
    start_sim_fleet,
)
from kvgate.loadtest.kit.report import write_samples
from kvgate.loadtest.kit.stream import RequestSample
from kvgate.loadtest.routing.client import ChatLoad, Load
from kvgate.loadtest.routing.report import (
    BASELINE_POLICY,
    EXTERNAL,
    KVGATE,
    ORACLE,
    PRESSURE_ORACLE,
    RowPlan,
    RowRun,
    ScenarioRun,
)
from kvgate.loadtest.routing.workload import (
    CHARS_PER_TOKEN,
    REAL_TOKENIZER_CHARS_PER_TOKEN,
    Footprint,
    fleet_options,
    oracle_options,
    pressure_oracle_options,
)
from kvgate.simulator import SimOptions

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
_PROGRESS_INTERVAL_SECONDS = 5.0
FRONT_POLICY = "round-robin"  # the front that spreads a one-URL load generator over several gateways


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """Everything one routing benchmark needs."""

    loads: tuple[Load, ...]
    replicas: int
    policies: tuple[str, ...]  # kvgate policies measured besides the round-robin baseline
    gateways: int  # gateways of the multi-gateway cache-aware row; below 2 leaves it out
    externals: tuple[tuple[str, str], ...]  # (row name, command line template)
    cache_fraction: float
    sim: SimOptions  # timing knobs every simulated replica shares
    out_dir: Path
    runs: int = 1  # measured runs of every row
    vllm_python: str | None = None  # real vLLM engines (this interpreter has vLLM) instead of simulated replicas
    # Precise routing rows: the replicas publish KV events; simulated ones tokenize with this model directory.
    tokenizer_dir: Path | None = None

    def fleet_options(self, load: Load) -> SimOptions:
        """Settings of each fleet replica for a load (publishing KV events in precise mode)."""
        return fleet_options(self._footprint(load), load.model, self.sim, self.cache_fraction, self.tokenizer_dir)

    def oracle_options(self, load: Load) -> SimOptions:
        """Settings of the oracle replica for a load."""
        return oracle_options(self._footprint(load), load.model, self.sim, self.tokenizer_dir)

    def _footprint(self, load: Load) -> Footprint:
        return load.footprint(self.sim.block_size,
                              REAL_TOKENIZER_CHARS_PER_TOKEN if self.tokenizer_dir else CHARS_PER_TOKEN)


def plan_rows(settings: BenchSettings) -> list[RowPlan]:
    """The rows of every load: oracle, baseline, each policy, several gateways, precise routing, external routers."""
    rows = [RowPlan(ORACLE, ORACLE), RowPlan(BASELINE_POLICY, KVGATE, policy=BASELINE_POLICY)]
    rows += [RowPlan(policy, KVGATE, policy=policy) for policy in settings.policies if policy != BASELINE_POLICY]
    scaled = f" x{settings.gateways}"
    if settings.gateways > 1:
        rows.append(RowPlan("cache-aware" + scaled, KVGATE, policy="cache-aware", gateways=settings.gateways))
        rows.append(RowPlan(f"cache-aware{scaled} shared", KVGATE, policy="cache-aware", gateways=settings.gateways,
                            shared=True))
    if settings.tokenizer_dir is not None:
        rows.insert(1, RowPlan(PRESSURE_ORACLE, PRESSURE_ORACLE))
        rows.append(RowPlan("cache-aware precise", KVGATE, policy="cache-aware", precise=True))
        if settings.gateways > 1:
            rows.append(RowPlan("cache-aware precise" + scaled, KVGATE, policy="cache-aware",
                                gateways=settings.gateways, precise=True))
            rows.append(RowPlan(f"cache-aware precise{scaled} shared", KVGATE, policy="cache-aware",
                                gateways=settings.gateways, precise=True, shared=True))
    return rows + [RowPlan(name, EXTERNAL, template=template) for name, template in settings.externals]


async def run_bench(settings: BenchSettings, progress: Progress) -> list[ScenarioRun]:
    """Every load's rows one at a time against replicas started for that load, reset between rows."""
    scenarios: list[ScenarioRun] = []
    for load in settings.loads:
        async with AsyncExitStack() as stack:
            fleet, probe = await stack.enter_async_context(_replicas(settings, load, settings.out_dir / "logs"))
            session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
            simulated = settings.vllm_python is None
            scenario = ScenarioRun(load.name, load.describe(), load.skewed,
                                   settings.fleet_options(load) if simulated else None,
                                   settings.oracle_options(load) if simulated else None)
            for plan in plan_rows(settings):
                for run in range(settings.runs):
                    label = f"{load.name}/{plan.name}" + (f" #{run + 1}" if settings.runs > 1 else "")
                    row = await _run_row(settings, load, plan, fleet, probe, session, label, progress)
                    scenario.rows.append(row)
                    progress(_row_line(label, row))
        scenarios.append(scenario)
    return scenarios


async def _run_row(settings: BenchSettings, load: Load, plan: RowPlan, fleet: RunningFleet, probe: ReplicaProbe,
                   session: aiohttp.ClientSession, label: str, progress: Progress) -> RowRun:
    """One measured run of one row; a row whose processes fail is recorded with the reason."""
    row = RowRun(plan)
    sim_urls = fleet.direct.get(plan.kind, fleet.urls)
    log_dir, work_dir = settings.out_dir / "logs", settings.out_dir / "runs" / label.replace(" ", "").replace("#", "-")
    try:
        async with _routers(plan, fleet, log_dir, load) as gateways:
            await reset_for_row(session, probe, sim_urls, gateways, plan.precise)
            async with _front(load, gateways, log_dir, label) as targets:
                await _measure(row, session, sim_urls, targets or sim_urls, load, work_dir, probe, label, progress)
            if plan.kind == KVGATE:
                row.decisions = await read_decisions(session, gateways)
    except (ProcessError, TimeoutError) as exc:  # a router that would not start, or not follow the KV events
        row.error = str(exc).splitlines()[0]
        log.warning("bench row failed row=%s error=%s", label, exc)
    return row


@asynccontextmanager
async def _replicas(settings: BenchSettings, load: Load, log_dir: Path) -> AsyncIterator[tuple[RunningFleet, ReplicaProbe]]:
    """The replicas of a load and how to read them: simulated replicas, or real engines."""
    if settings.vllm_python is not None:
        from kvgate.loadtest.routing.vllm_fleet import vllm_fleet

        assert isinstance(load, ChatLoad), "real engines are sized for the chat loads"
        async with vllm_fleet(load.spec, settings.replicas, settings.cache_fraction, settings.vllm_python,
                              settings.out_dir / "vllm", settings.tokenizer_dir is not None) as engines:
            yield engines, VllmProbe()
        return
    async with AsyncExitStack() as stack:

        async def started(suffix: str, replicas: int, options: SimOptions) -> list[str]:
            sims = start_sim_fleet(f"{load.name}-{suffix}", replicas, options, log_dir)
            return await stack.enter_async_context(running(sims))

        options = settings.fleet_options(load)
        urls = await started("fleet", settings.replicas, options)
        direct = {ORACLE: await started("oracle", 1, settings.oracle_options(load))}  # rows sent straight to it
        flags: list[str] = []
        if settings.tokenizer_dir is not None:
            pressure = pressure_oracle_options(options, settings.replicas)
            direct[PRESSURE_ORACLE] = await started("pressure-oracle", 1, pressure)
            flags = precise_args(urls, options, settings.tokenizer_dir)
        yield RunningFleet(urls, direct, flags), SimProbe()


def precise_args(endpoints: Sequence[str], options: SimOptions, tokenizer_dir: Path) -> list[str]:
    """`kvgate serve` flags that subscribe to each simulated replica's KV events and tokenize as it does."""
    args = []
    for url in endpoints:
        port, offset = int(url.rpartition(":")[2]), options.kv_events_port_offset
        args += ["--kv-events-endpoint", f"{url}=tcp://127.0.0.1:{port + offset}",
                 "--kv-events-replay-endpoint", f"{url}=tcp://127.0.0.1:{port + 2 * offset}"]
    return [*args, "--tokenizer", f"{options.models[0]}={tokenizer_dir}"]


@asynccontextmanager
async def _routers(plan: RowPlan, fleet: RunningFleet, log_dir: Path, load: Load) -> AsyncIterator[list[str]]:
    """Start the row's router processes; yields their base URLs (none for the oracles: traffic goes direct)."""
    async with AsyncExitStack() as stack:
        urls: list[str] = []
        flags = [] if plan.policy is None else ["--policy", plan.policy]
        flags += fleet.precise_flags if plan.precise else []
        count = plan.gateways if plan.kind in (KVGATE, EXTERNAL) else 0
        peers = peer_flags(count, plan.shared)
        for index in range(count):
            name = f"{load.name}-{plan.name}-{index}".replace(" ", "")
            if plan.kind == KVGATE:
                started = start_gateway(name, fleet.urls, [*flags, *peers[index]], log_dir)
            else:
                started = start_external(name, plan.template or "", fleet.urls, log_dir)
            urls.append(await stack.enter_async_context(running(started)))
        yield urls


@asynccontextmanager
async def _front(load: Load, gateways: list[str], log_dir: Path, label: str) -> AsyncIterator[list[str]]:
    """The URLs the load goes to: the gateways, or a round-robin kvgate in front of them for a one-URL generator."""
    if len(gateways) < 2 or not load.single_target:
        yield gateways
        return
    name = f"{label}-front".replace(" ", "").replace("/", "-").replace("#", "")
    async with running(start_gateway(name, gateways, ["--policy", FRONT_POLICY], log_dir)) as url:
        yield [url]


async def _measure(row: RowRun, session: aiohttp.ClientSession, sim_urls: Sequence[str], targets: Sequence[str],
                   load: Load, work_dir: Path, probe: ReplicaProbe, label: str, progress: Progress) -> None:
    """Drive the load through `targets` while sampling the replicas' load, printing progress; fill in `row`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    done: list[RequestSample] = []

    async def tick() -> None:
        if elapsed := round(loop.time() - start):
            errors = sum(sample.error is not None for sample in done)
            progress(f"  {label}: {elapsed}s, {len(done)} requests, {errors} errors")

    async with sampling_load(session, sim_urls, probe) as series, sampling(_PROGRESS_INTERVAL_SECONDS, tick):
        row.samples = await load.drive(targets, work_dir, done.append)
        row.wall_seconds = loop.time() - start
    write_samples(work_dir / "samples.jsonl", row.samples)
    row.load = series
    row.replica_stats = await probe.stats(session, sim_urls)


def _row_line(label: str, row: RowRun) -> str:
    """The one-line outcome of a row."""
    if row.error is not None:
        return f"{label}: FAILED: {row.error}"
    hit_rate = "n/a" if row.hit_rate is None else f"{row.hit_rate:.1%}"
    return f"{label}: {len(row.samples)} requests in {row.wall_seconds:.1f}s, hit rate {hit_rate}, {row.errors} errors"
