"""`kvgate bench soak`: kvgate under minutes of streaming load with faults; is its memory flat and do descriptors
come back? The children's logs go to OUT/logs, the plot to OUT/soak.png."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.loadtest.kit.processes import ChildProcess, base_url, free_ports, start_gateway, start_sim_fleet
from kvgate.loadtest.kit.report import BadOption, RunMeta, publish
from kvgate.loadtest.soak.load import LoadShape, SoakLoad
from kvgate.loadtest.soak.report import ProcessSampler, cpu_summary, fd_summary, memory_summary, plot, render_markdown
from kvgate.simulator import SimOptions

log = logging.getLogger(__name__)

# Gateway counters worth reporting, and the label that splits each.
_GATEWAY_COUNTERS = {"kvgate_upstream_errors": "kind", "kvgate_retries": "cause", "kvgate_rejected_requests": "reason",
                     "kvgate_requests_in_flight": None}


@dataclass(frozen=True, slots=True)
class SoakPlan:
    """How long the soak runs, what load it offers and which faults it injects."""

    minutes: float
    shape: LoadShape
    replicas: int
    sim: SimOptions
    sample_interval_s: float
    warmup_s: float  # memory trends are judged on the samples after this
    kill_interval_s: float  # a replica is killed this often (round robin) ...
    replica_down_s: float  # ... and restarted on the same port after this long
    settle_s: float  # sampling goes on this long after the load, for descriptors to return

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class SimReplicaProcess:
    """One simulated replica in its own process on a fixed port, so a restart comes back at the same URL."""

    def __init__(self, name: str, options: SimOptions, log_dir: Path) -> None:
        (self.port,) = free_ports(1)
        self.url = base_url(self.port)
        self._name, self._options, self._log_dir = name, options, log_dir
        self._starts = 0
        self._child: ChildProcess | None = None

    async def start(self) -> None:
        """Start (or restart) the replica and wait until /health answers."""
        self._starts += 1
        self._child, _ = await start_sim_fleet(f"{self._name}-{self._starts}", 1, self._options, self._log_dir,
                                               [self.port])

    async def kill(self) -> None:
        """Kill the replica's process with SIGKILL."""
        child, self._child = self._child, None
        if child is not None:
            await child.kill()

    async def stop(self) -> None:
        """Stop the replica gracefully, if it runs."""
        child, self._child = self._child, None
        if child is not None:
            await child.stop()


class _Clock:
    """Seconds since the soak's sampling began."""

    def __init__(self) -> None:
        self._start = asyncio.get_running_loop().time()

    def now(self) -> float:
        return round(asyncio.get_running_loop().time() - self._start, 2)


async def _kill_replicas(replicas: list[SimReplicaProcess], plan: SoakPlan, clock: _Clock,
                         events: list[dict[str, Any]]) -> None:
    """Kill one replica at a time with SIGKILL and bring it back, until cancelled."""
    for round_number in itertools.count():  # ends when cancelled at the end of the load
        await asyncio.sleep(plan.kill_interval_s)
        victim = replicas[round_number % len(replicas)]
        try:
            await victim.kill()
            events.append({"t": clock.now(), "event": "kill", "replica": victim.url})
            await asyncio.sleep(plan.replica_down_s)
        finally:
            await victim.start()  # even when cancelled: the fleet is whole again before the settle phase
            events.append({"t": clock.now(), "event": "restart", "replica": victim.url})


async def gateway_counters(url: str) -> dict[str, dict[str, float]]:
    """kvgate's error, retry and in-flight metrics, summed per label value."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
    counters: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in _GATEWAY_COUNTERS:
            continue
        label = _GATEWAY_COUNTERS[family.name]
        values = counters.setdefault(family.name.removeprefix("kvgate_"), {})
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            key = sample.labels.get(label, "") if label else "total"
            values[key] = values.get(key, 0.0) + sample.value
    return counters


def _tracebacks(log_path: Path) -> int:
    """Tracebacks kvgate logged: expected faults must be one-line log messages."""
    return log_path.read_text(errors="replace").count("Traceback (most recent call last)")


async def run_soak(plan: SoakPlan, log_dir: Path) -> dict[str, Any]:
    """Run the soak and return its report as JSON-ready data."""
    replicas = [SimReplicaProcess(f"replica-{n}", plan.sim, log_dir) for n in range(plan.replicas)]
    try:
        await asyncio.gather(*(replica.start() for replica in replicas))
        kvgate, url = await start_gateway("kvgate", [replica.url for replica in replicas], (), log_dir)
        try:
            assert kvgate.pid is not None
            return await _measure(plan, url, kvgate.pid, replicas, log_dir)
        finally:
            await kvgate.stop()
    finally:
        await asyncio.gather(*(replica.stop() for replica in replicas), return_exceptions=True)


async def _measure(plan: SoakPlan, url: str, pid: int, replicas: list[SimReplicaProcess],
                   log_dir: Path) -> dict[str, Any]:
    load_s = plan.minutes * 60
    sampler = ProcessSampler(pid, plan.sample_interval_s)
    baseline = sampler.sample(0.0, 0.0)
    clock = _Clock()
    events: list[dict[str, Any]] = []
    sampling = asyncio.create_task(sampler.run(load_s + plan.settle_s + 600))
    killing = asyncio.create_task(_kill_replicas(replicas, plan, clock, events))
    load = SoakLoad(url, plan.shape)
    try:
        await load.run(load_s)
    finally:
        killing.cancel()
        await asyncio.gather(killing, return_exceptions=True)
    load_end = clock.now()
    log.info("load ended t=%.1f requests=%d; settling for %.0fs", load_end, sum(load.tally.started.values()),
             plan.settle_s)
    await asyncio.sleep(plan.settle_s)
    sampling.cancel()
    await asyncio.gather(sampling, return_exceptions=True)
    samples = sampler.samples
    requests = sum(load.tally.started.values())
    return {
        "plan": plan.to_json(),
        "load_end_s": load_end,
        "requests": requests,
        "requests_per_s": round(requests / load_end, 1) if load_end else 0.0,
        "lost": load.tally.lost(),
        "by_kind": load.tally.to_json(),
        "gateway": await gateway_counters(url),
        "tracebacks": _tracebacks(log_dir / "kvgate.log"),
        "events": events,
        "memory": memory_summary(samples, plan.warmup_s, load_end),
        "fds": fd_summary(samples, baseline, load_end),
        "cpu": cpu_summary(samples, load_end),
        "samples": [sample.to_json() for sample in samples],
    }


_SHAPE = LoadShape(model=SimOptions().models[0], concurrency=240, max_tokens=48, think_s=2.0, fault_interval_s=10.0,
                   aborts_per_round=5, slow_readers_per_round=2, slow_reader_max_tokens=300, slow_read_bytes=512,
                   slow_read_interval_s=0.05, slow_read_max_s=40.0)
FULL = SoakPlan(minutes=10, shape=_SHAPE, replicas=3, sim=SimOptions(max_num_seqs=128, decode_step_seconds=0.03),
                sample_interval_s=5.0, warmup_s=120.0, kill_interval_s=60.0, replica_down_s=5.0, settle_s=75.0)
QUICK = dataclasses.replace(
    FULL, minutes=0.5, sample_interval_s=1.0, warmup_s=10.0, kill_interval_s=10.0, replica_down_s=2.0, settle_s=3.0,
    shape=dataclasses.replace(_SHAPE, concurrency=30, think_s=0.5, fault_interval_s=5.0, aborts_per_round=2,
                              slow_readers_per_round=1, slow_reader_max_tokens=100, slow_read_max_s=15.0))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The number of steady clients (--duration is the load's length in seconds)."""
    parser.add_argument("--concurrency", type=int, help="steady streaming clients")


def plan_from(options: argparse.Namespace) -> SoakPlan:
    """The preset the flags pick, with the flags' overrides; BadOption for a value that makes no sense."""
    plan = QUICK if options.quick else FULL
    if options.duration is not None:
        if options.duration <= 0:
            raise BadOption("--duration must be > 0")
        plan = dataclasses.replace(plan, minutes=options.duration / 60, warmup_s=min(plan.warmup_s, options.duration / 3))
    shape = plan.shape
    if options.concurrency is not None:
        if options.concurrency < 1:
            raise BadOption("--concurrency must be >= 1")
        shape = dataclasses.replace(shape, concurrency=options.concurrency)
    if options.seed is not None:
        shape = dataclasses.replace(shape, seed=options.seed)
    return dataclasses.replace(plan, shape=shape)


def run(options: argparse.Namespace) -> int:
    """Run the soak, write soak.{json,md,png} and the docs section, print the Markdown."""
    plan = plan_from(options)
    logging.getLogger("kvgate.loadtest").setLevel(logging.INFO)
    meta = RunMeta()
    report = asyncio.run(run_soak(plan, options.out / "logs"))
    report["meta"] = meta.finish(command=options.command, plot=str(options.out / "soak.png"))
    options.out.mkdir(parents=True, exist_ok=True)
    plot(report, options.out / "soak.png")
    publish(options.out, "soak", report, render_markdown(report), options.docs)
    return 0
