"""Runs the priority benchmark: capacity probe, unloaded baseline, then each overload row on a fresh fleet."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.loadtest.kit.gateway_metrics import metric_samples
from kvgate.loadtest.kit.processes import start_gateway, start_sim_fleet, stopping
from kvgate.loadtest.priority.client import BodyFor, measure_throughput, run_open_loop
from kvgate.loadtest.priority.probe import QueueProbe
from kvgate.loadtest.priority.rows import ADMISSION, FIFO, ROWS
from kvgate.loadtest.priority.summary import RunResult, summarise, verdict
from kvgate.loadtest.priority.workload import INTERACTIVE, Arrival, output_tokens_max, poisson_arrivals, request_body
from kvgate.simulator import SimOptions

Progress = Callable[[str], None]
_ADMISSION_METRICS = ("kvgate_admission_dispatched", "kvgate_admission_shed", "kvgate_admission_wait_seconds",
                      "kvgate_admission_preempted")
_COUNTED_SUFFIXES = ("_total", "_sum", "_count")


@dataclass(frozen=True, slots=True)
class Services:
    """Where a run sends its load, and the replicas behind it."""

    gateway_url: str
    replica_urls: list[str]


@asynccontextmanager
async def _gateway(name: str, urls: list[str], flags: Sequence[str], log_dir: Path) -> AsyncIterator[Services]:
    """A kvgate gateway with `flags` in front of the replicas at `urls`."""
    gateway, url = await start_gateway(f"{name}-kvgate", urls, flags, log_dir)
    async with stopping(gateway):
        yield Services(url, urls)


@asynccontextmanager
async def _services(name: str, replicas: int, options: SimOptions, flags: Sequence[str],
                    log_dir: Path) -> AsyncIterator[Services]:
    """A fresh simulated fleet and a gateway in front of it."""
    fleet, urls = await start_sim_fleet(f"{name}-sim", replicas, options, log_dir)
    async with stopping(fleet), _gateway(name, urls, flags, log_dir) as target:
        yield target


async def admission_counters(gateway_url: str) -> dict[str, float]:
    """The gateway's admission counters (dispatched, shed, preempted, wait sum and count) keyed by name and labels."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        samples = await metric_samples(session, gateway_url, _ADMISSION_METRICS)
    counters: dict[str, float] = {}
    for sample in samples:
        if sample.name.endswith(_COUNTED_SUFFIXES):
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            counters[f"{sample.name.removeprefix('kvgate_admission_')}{{{labels}}}"] = sample.value
    return counters


@dataclass(frozen=True, slots=True)
class Plan:
    """Fleet, load and durations of one benchmark."""

    replicas: int
    sim: SimOptions
    max_tokens: int
    prompt_words: int
    capacity_s: float
    unloaded_s: float
    overload_s: float
    rows: tuple[str, ...]
    unloaded_fraction: float = 0.2  # of capacity, interactive only
    overload_factor: float = 2.0  # offered load against capacity
    batch_fraction: float = 0.7
    lead_in_s: float = 5.0  # interactive traffic alone before the batch flood starts
    seed: int = 1

    @property
    def drain_cap_s(self) -> float:
        """How long a run waits for open requests after its last send: the backlog's drain time, with margin."""
        return 1.5 * self.overload_s * (self.overload_factor - 1) + 10

    def _full_batch_step_s(self) -> float:
        """Seconds of one decode step with every seat busy, from the simulator's timing model."""
        sim = self.sim
        return sim.scaled(sim.decode_step_seconds + sim.decode_seconds_per_seq * sim.max_num_seqs)

    def derived_capacity(self) -> float:
        """Requests per second the fleet completes with every seat busy, from the simulator's timing model."""
        return self.replicas * self.sim.max_num_seqs / (self.max_tokens * self._full_batch_step_s())

    @property
    def capacity_warmup_s(self) -> float:
        """How long the capacity probe runs before it counts: its first wave starts at once on a cold fleet, and
        completions reach the steady rate only once the longest request of that wave has finished."""
        return output_tokens_max(self.max_tokens) * self._full_batch_step_s()

    def body_for(self, arrival: Arrival, batch_stream: bool = False) -> bytes:
        """The body of one request: interactive ones stream, batch ones read whole answers unless `batch_stream`."""
        stream = arrival.priority == INTERACTIVE or batch_stream
        return request_body(self.sim.models[0], arrival.index, self.prompt_words, self.max_tokens, stream)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON."""
        return {**dataclasses.asdict(self), "drain_cap_s": self.drain_cap_s,
                "capacity_warmup_s": round(self.capacity_warmup_s, 2)}


async def _run(plan: Plan, target: Services, key: str, title: str, rate: float, duration: float,
               batch_fraction: float, seed: int, body_for: BodyFor, lead_in_s: float = 0.0) -> RunResult:
    """One open-loop run against `target`, its queues sampled while the load is on."""
    arrivals = poisson_arrivals(rate, duration, batch_fraction, seed, lead_in_s)
    probe = QueueProbe(target.gateway_url, target.replica_urls)
    probing = asyncio.create_task(probe.run())
    asyncio.get_running_loop().call_later(lead_in_s + duration, probing.cancel)
    try:
        samples = await run_open_loop(target.gateway_url, arrivals, body_for, plan.drain_cap_s)
    finally:
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
    counters = await admission_counters(target.gateway_url)
    return summarise(key, title, rate, duration, samples, probe.summary(), counters, lead_in_s)


async def run_benchmark(plan: Plan, log_dir: Path, progress: Progress) -> dict[str, Any]:
    """Every run of the plan, in order; the report as plain JSON."""
    seats = plan.replicas * plan.sim.max_num_seqs
    fleet, urls = await start_sim_fleet("capacity-sim", plan.replicas, plan.sim, log_dir)
    async with stopping(fleet):
        capacity = await measure_throughput(urls, 2 * seats, plan.capacity_warmup_s, plan.capacity_s, plan.body_for)
        progress(f"capacity: measured {capacity:.1f} req/s, derived {plan.derived_capacity():.1f} req/s")
        async with _gateway("unloaded", urls, ADMISSION.gateway_flags(plan.sim), log_dir) as target:
            unloaded = await _run(plan, target, "unloaded", f"{ADMISSION.title}, interactive only",
                                  plan.unloaded_fraction * capacity, plan.unloaded_s, 0.0, plan.seed, plan.body_for)
    progress(f"unloaded: interactive TTFT p50 {unloaded.interactive.ttft_p50_ms} ms "
             f"p99 {unloaded.interactive.ttft_p99_ms} ms")
    runs: list[RunResult] = []
    for key in plan.rows:
        row = ROWS[key]
        async with _services(f"row-{key}", plan.replicas, row.sim_options(plan.sim), row.gateway_flags(plan.sim),
                            log_dir) as target:
            run = await _run(plan, target, key, row.title, plan.overload_factor * capacity,
                             plan.overload_s, plan.batch_fraction, plan.seed + 1,
                             functools.partial(plan.body_for, batch_stream=row.batch_stream), plan.lead_in_s)
        runs.append(run)
        progress(f"row {key}: interactive TTFT p99 {run.interactive.ttft_p99_ms} ms, batch ok {run.batch.ok} "
                 f"shed {run.batch.shed} lost {run.lost}, wall {run.wall_s} s, replica queue mean "
                 f"{run.queues.replica_waiting_mean}")
    fifo = next((run for run in runs if run.key == FIFO.key), None)
    verdicts = [verdict(run, unloaded, fifo) for run in runs if ROWS[run.key].admission]
    return {
        "plan": plan.to_json(),
        "capacity": {"measured_rps": round(capacity, 1), "derived_rps": round(plan.derived_capacity(), 1),
                     "seats": seats},
        "unloaded": unloaded.to_json(),
        "runs": [run.to_json() for run in runs],
        "verdicts": [{**dataclasses.asdict(v), "passed": v.passed} for v in verdicts],
    }
