"""`kvgate bench soak`: kvgate under minutes of streaming load with faults; is its memory flat and do descriptors
come back? The children's logs go to OUT/logs, the plot to OUT/soak.png."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.loadtest.cli import with_knobs
from kvgate.loadtest.kit.counters import metric_samples, sampling
from kvgate.loadtest.kit.processes import ChildProcess, base_url, free_ports, start_gateway, start_sim_fleet, stopping
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


_SHAPE = LoadShape(model=SimOptions().models[0], concurrency=240, max_tokens=48, think_s=2.0, fault_interval_s=10.0,
                   aborts_per_round=5, slow_readers_per_round=2, slow_reader_max_tokens=300, slow_read_bytes=512,
                   slow_read_interval_s=0.05, slow_read_max_s=40.0)
FULL = SoakPlan(minutes=10, shape=_SHAPE, replicas=3, sim=SimOptions(max_num_seqs=128, decode_step_seconds=0.03),
                sample_interval_s=5.0, warmup_s=120.0, kill_interval_s=60.0, replica_down_s=5.0, settle_s=75.0)
QUICK = dataclasses.replace(
    FULL, minutes=0.5, sample_interval_s=1.0, warmup_s=10.0, kill_interval_s=10.0, replica_down_s=2.0, settle_s=3.0,
    shape=dataclasses.replace(_SHAPE, concurrency=30, think_s=0.5, fault_interval_s=5.0, aborts_per_round=2,
                              slow_readers_per_round=1, slow_reader_max_tokens=100, slow_read_max_s=15.0))


class _Replica:
    """One `kvgate sim` replica in its own process on a fixed port, so that a restart comes back at the same URL."""

    def __init__(self, options: SimOptions, log_dir: Path) -> None:
        (self.port,) = free_ports(1)
        self.url = base_url(self.port)
        self._options, self._log_dir, self._starts = options, log_dir, 0
        self.child: ChildProcess | None = None

    async def start(self) -> None:
        """Start (or restart) the replica and wait until /health answers."""
        self._starts += 1
        name = f"replica-{self.port}-{self._starts}"
        self.child, _ = await start_sim_fleet(name, 1, self._options, self._log_dir, [self.port])

    async def stop(self, kill: bool = False) -> None:
        """Stop the replica gracefully, or with `kill` by SIGKILL, if it runs."""
        child, self.child = self.child, None
        if child is not None:
            await child.stop(kill)


async def _kill_replicas(replicas: list[_Replica], plan: SoakPlan, now: Callable[[], float],
                         events: list[dict[str, Any]]) -> None:
    """Kill one replica at a time with SIGKILL and bring it back, until cancelled."""
    for round_number in itertools.count():  # ends when cancelled at the end of the load
        await asyncio.sleep(plan.kill_interval_s)
        victim = replicas[round_number % len(replicas)]
        try:
            await victim.stop(kill=True)
            events.append({"t": now(), "event": "kill", "replica": victim.url})
            await asyncio.sleep(plan.replica_down_s)
        finally:
            await victim.start()  # even when cancelled: the fleet is whole again before the settle phase
            events.append({"t": now(), "event": "restart", "replica": victim.url})


async def gateway_counters(url: str) -> dict[str, dict[str, float]]:
    """kvgate's error, retry and in-flight metrics, summed per label value."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        samples = await metric_samples(session, url, _GATEWAY_COUNTERS)
    counters: dict[str, dict[str, float]] = {}
    for sample in samples:
        family = next(name for name in _GATEWAY_COUNTERS if sample.name.startswith(name))
        if not sample.name.endswith("_created"):
            label = _GATEWAY_COUNTERS[family]
            values = counters.setdefault(family.removeprefix("kvgate_"), {})
            key = sample.labels.get(label, "") if label else "total"
            values[key] = values.get(key, 0.0) + sample.value
    return counters


async def run_soak(plan: SoakPlan, log_dir: Path) -> dict[str, Any]:
    """kvgate in front of a fleet under the load and its faults, kvgate sampled throughout; the report as plain JSON."""
    replicas = [_Replica(plan.sim, log_dir) for _ in range(plan.replicas)]
    try:
        await asyncio.gather(*(replica.start() for replica in replicas))
        kvgate, url = await start_gateway("kvgate", [replica.url for replica in replicas], (), log_dir)
        async with stopping(kvgate):
            assert kvgate.pid is not None
            sampler = ProcessSampler(kvgate.pid)
            before = sampler.read()
            events: list[dict[str, Any]] = []
            load = SoakLoad(url, plan.shape)
            async with sampling(plan.sample_interval_s, sampler.record):
                killing = asyncio.create_task(_kill_replicas(replicas, plan, sampler.elapsed, events))
                try:
                    await load.run(plan.minutes * 60)
                finally:
                    killing.cancel()
                    await asyncio.gather(killing, return_exceptions=True)
                load_end, requests = sampler.elapsed(), sum(load.tally.started.values())
                log.info("load ended t=%.1f requests=%d; settling for %.0fs", load_end, requests, plan.settle_s)
                await asyncio.sleep(plan.settle_s)
            gateway = await gateway_counters(url)
    finally:
        await asyncio.gather(*(replica.stop() for replica in replicas), return_exceptions=True)
    samples = sampler.samples
    return {
        "plan": dataclasses.asdict(plan), "load_end_s": load_end, "requests": requests,
        "requests_per_s": round(requests / load_end, 1) if load_end else 0.0,
        "lost": load.tally.lost(), "by_kind": load.tally.to_json(), "gateway": gateway,
        # expected faults must be one-line log messages
        "tracebacks": (log_dir / "kvgate.log").read_text(errors="replace").count("Traceback (most recent call last)"),
        "events": events, "memory": memory_summary(samples, plan.warmup_s, load_end),
        "fds": fd_summary(samples, before["fds"], load_end), "cpu": cpu_summary(samples, load_end), "samples": samples,
    }  # fmt: skip


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
    if options.concurrency is not None and options.concurrency < 1:
        raise BadOption("--concurrency must be >= 1")
    return dataclasses.replace(plan, shape=with_knobs(options, plan.shape, ("concurrency", "seed")))


def run(options: argparse.Namespace) -> int:
    """Run the soak, write soak.{json,md,png} and the docs section, print the Markdown."""
    plan = plan_from(options)
    logging.getLogger("kvgate.loadtest").setLevel(logging.INFO)
    meta = RunMeta()
    report = asyncio.run(run_soak(plan, options.out / "logs"))
    report["meta"] = meta.finish(command=options.command, plot=str(options.out / "soak.png"))
    plot(report, options.out / "soak.png")
    publish(options.out, "soak", report, render_markdown(report), options.docs)
    return 0
