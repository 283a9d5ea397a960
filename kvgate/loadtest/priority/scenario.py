"""`kvgate bench priority`: interactive latency and batch throughput under overload, with and without admission
control, on simulated replicas or real vLLM engines; the children's logs go to OUT/logs."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.loadtest.kit.counters import SAMPLE_INTERVAL_SECONDS as _QUEUE_SAMPLE_SECONDS
from kvgate.loadtest.kit.counters import ReplicaProbe, SimProbe, VllmProbe, metric_samples, sampling
from kvgate.loadtest.kit.processes import free_ports, running, start_gateway, start_sim_fleet
from kvgate.loadtest.kit.tiny_model import write_tiny_model
from kvgate.loadtest.kit.vllm_engine import EngineSpec, require_vllm_python, running_engines
from kvgate.loadtest.kit.report import BadOption, RunMeta, publish
from kvgate.loadtest.priority.client import (
    INTERACTIVE,
    Arrival,
    BodyFor,
    measure_throughput,
    output_tokens_max,
    poisson_arrivals,
    request_body,
    run_open_loop,
)
from kvgate.loadtest.priority.report import QueueSamples, RunResult, render_markdown, summarise, verdict
from kvgate.loadtest.routing.workload import system_prompt
from kvgate.simulator import SimOptions

# Thresholds no fleet reaches: every request goes straight through, first come first served at the replicas.
NO_ADMISSION_FLAGS = ("--saturation-queue", "1000000", "--saturation-seated-queue", "1000000",
                      "--saturation-kv-cache", "1.0", "--admission-reserve", "batch=0", "--admission-preemptible", "")
_ADMISSION_METRICS = ("kvgate_admission_dispatched", "kvgate_admission_shed", "kvgate_admission_wait_seconds",
                      "kvgate_admission_preempted")


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One configuration of gateway and replicas measured under the same overload."""

    key: str
    title: str
    policy: str = "cache-aware"
    admission: bool = True
    upstream_priority: bool = True  # kvgate sets vLLM's `priority`; the replicas order their queue by it
    seats_learned: bool = False  # kvgate learns the replicas' max_num_seqs from /metrics instead of being told it
    no_config: bool = False  # `kvgate serve --endpoints ...` and nothing else: kvgate's defaults, seats learned
    batch_stream: bool = False  # batch requests stream (so kvgate cannot preempt them) instead of reading whole answers
    batch: bool = True  # the flood's batch requests are sent; without them the row is its interactive requests alone

    @property
    def judged(self) -> bool:
        """Whether the row is held to the targets: admission control under the whole flood."""
        return self.admission and self.batch

    def sim_options(self, base: SimOptions) -> SimOptions:
        """Replica settings of this row: `base`, with priority scheduling when kvgate sends priorities."""
        return dataclasses.replace(base, priority_scheduling=self.upstream_priority)

    def gateway_flags(self, sim: SimOptions) -> list[str]:
        """`kvgate serve` flags of this row in front of replicas run with `sim`, besides listen and endpoints."""
        if self.no_config:
            return []
        flags = ["--policy", self.policy]
        if not self.admission:
            flags += NO_ADMISSION_FLAGS
        elif not self.seats_learned:  # as the manifests in deploy/ do
            flags += ["--saturation-seats", str(sim.max_num_seqs)]
        return flags + (["--upstream-priority", "true"] if self.upstream_priority else [])


ADMISSION = RowSpec("a", "cache-aware + admission control as deploy/ ships it: max_num_seqs configured, "
                         "upstream priority")
FIFO = RowSpec("b", "cache-aware, FIFO (no admission control)", admission=False, upstream_priority=False)
ROWS = {row.key: row for row in (
    ADMISSION, FIFO,
    RowSpec("c", "round-robin, FIFO (no admission control)", policy="round-robin", admission=False,
            upstream_priority=False),
    RowSpec("d", "as (a), replicas first come first served (no upstream priority)", upstream_priority=False),
    RowSpec("e", "as (a), with max_num_seqs learned from /metrics instead of configured", seats_learned=True),
    RowSpec("f", "as (a), with batch requests streamed: not preemptible, they leave a reserve", batch_stream=True),
    RowSpec("g", "kvgate with no configuration (defaults, seats learned, replicas first come first served), batch "
                 "streamed", upstream_priority=False, no_config=True, batch_stream=True),
    RowSpec("h", "kvgate with no configuration, batch reading whole answers", upstream_priority=False, no_config=True),
    RowSpec("i", "kvgate with no configuration, the flood's interactive requests alone (no batch)",
            upstream_priority=False, no_config=True, batch=False),
)}


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
    real: bool = False  # real vLLM engines (the CPU build, one per core) with the sim's seats and model name
    # simulated engines that tokenize with the tiny test model's tokenizer (about 2.2 characters a token on these
    # prompts) instead of the simulator's 4 characters a token, the estimate kvgate starts from
    tokenized: bool = False
    # loads are multiples of this rate instead of the probe's: runs of different code meet the same load (a real
    # engine's probe moved between 16.6 and 46.5 req/s from run to run)
    capacity_rps: float | None = None
    # interactive requests each timed run sends at least: a run whose interactive rate is low lasts longer than its
    # preset, so that its TTFT p99 is not merely its slowest request (one of 27 in a 30 s unloaded run of 1 req/s)
    min_interactive: int = 0
    # > 0: each request's prompt opens with the system prompt of one of this many tenants (of
    # system_prompt_chars, picked at random per request), which replicas cache and share, as chat traffic does;
    # 0: every prompt is its own from its first word
    tenants: int = 0
    system_prompt_chars: int = 0

    def sized_for(self, capacity: float) -> Plan:
        """This plan at a capacity of `capacity` req/s: the unloaded and overload runs lengthened until each sends
        min_interactive interactive requests."""
        def lasting(seconds: float, interactive_rps: float) -> float:
            if interactive_rps <= 0:
                return seconds
            return max(seconds, float(math.ceil(self.min_interactive / interactive_rps)))

        return dataclasses.replace(
            self, unloaded_s=lasting(self.unloaded_s, self.unloaded_fraction * capacity),
            overload_s=lasting(self.overload_s, self.overload_factor * capacity * (1 - self.batch_fraction)))

    @property
    def drain_cap_s(self) -> float:
        """The longest a run waits for open requests after its last send, however steadily they end.

        The backlog is what the flood sent beyond the probed capacity; real engines drain it at 0.6-0.75x the
        probe's rate (the probe's closed loop keeps their seats fuller) and a probe can read high, so the cap is
        five times the backlog's time at the probed rate. A drain that stalls ends sooner (`stall_s`)."""
        return 5.0 * self.overload_s * (self.overload_factor - 1) + 30

    @property
    def stall_s(self) -> float:
        """How long a drain waits with no request ending before it counts the open ones as lost: three times the
        longest request's time on a full fleet, and at least 15 s."""
        return max(15.0, round(3 * self.capacity_warmup_s, 1))

    def _full_batch_step_s(self) -> float:
        """Seconds of one decode step with every seat busy, from the simulator's timing model."""
        sim = self.sim
        return sim.scaled(sim.decode_step_seconds + sim.decode_seconds_per_seq * sim.max_num_seqs)

    def derived_capacity(self) -> float:
        """Requests per second the fleet completes with every seat busy, from the simulator's timing model."""
        return self.replicas * self.sim.max_num_seqs / (self.max_tokens * self._full_batch_step_s())

    @property
    def capacity_warmup_s(self) -> float:
        """How long the capacity probe runs before it counts: until the longest request of its first wave (started
        at once on a cold fleet) has finished and completions reach their steady rate."""
        return output_tokens_max(self.max_tokens) * self._full_batch_step_s()

    def body_for(self, arrival: Arrival, batch_stream: bool = False) -> bytes:
        """The body of one request: interactive ones stream, batch ones read whole answers unless `batch_stream`."""
        stream = arrival.priority == INTERACTIVE or batch_stream
        return request_body(self.sim.models[0], arrival.index, self.prompt_words, self.max_tokens, stream,
                            self.system_prompt_of(arrival.index))

    def system_prompt_of(self, index: int) -> str:
        """The system prompt request `index` opens with: that of a tenant drawn for it (per index and seed); none
        without tenants."""
        if not self.tenants:
            return ""
        return system_prompt(random.Random(f"tenant-{self.seed}-{index}").randrange(self.tenants),
                             self.system_prompt_chars)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON."""
        return {**dataclasses.asdict(self), "drain_cap_s": self.drain_cap_s, "stall_s": self.stall_s,
                "capacity_warmup_s": round(self.capacity_warmup_s, 2)}


# Small enough for a 2-core machine: tens of requests per second, so the Python load generator keeps its schedule.
SIM = SimOptions(max_num_seqs=32, decode_step_seconds=0.05, default_max_tokens=32, speed=1.0)
FULL = Plan(replicas=3, sim=SIM, max_tokens=32, prompt_words=48, capacity_s=8,
            unloaded_s=30, overload_s=60, rows=("a", "b", "c", "d", "e", "f", "g", "h", "i"), min_interactive=200)
# Fleets whose binding limit differs (--fleet): seats; the KV cache (prompts of ~1,500 tokens, 500 blocks of 16
# tokens per replica: about 5 sequences fit in 8 seats); compute (256 seats, each running sequence slows a step).
_KV_BOUND = SimOptions(max_num_seqs=8, num_gpu_blocks=500, max_model_len=4096, decode_step_seconds=0.05,
                       default_max_tokens=32)
FLEETS = {
    "seats32": {},
    "kv-bound": {"sim": _KV_BOUND, "prompt_words": 1000, "rows": ("b", "g", "h", "i")},
    # The same cache, prompts of ~1,750 tokens that kvgate would take for ~950 at 4 characters a token.
    "kv-bound-tokenized": {"sim": _KV_BOUND, "prompt_words": 600, "rows": ("b", "g", "h", "i"), "tokenized": True},
    # The same cache, chat traffic as issue 16 describes it: 24 tenants' ~1,600-token system prompts (a replica's
    # cache holds about four), each request one of them and its own question of ~75 tokens.
    "kv-bound-chat": {"sim": _KV_BOUND, "prompt_words": 50, "tenants": 24, "system_prompt_chars": 6400,
                      "rows": ("b", "g", "h", "i")},
    "seats256": {"sim": SimOptions(max_num_seqs=256, num_gpu_blocks=4096, decode_step_seconds=0.02,
                                   decode_seconds_per_seq=0.0004, default_max_tokens=32), "rows": ("b", "g", "h", "i")},
    # Two real engines of 8 seats, the tiny model with dummy weights; row a: their queues ordered by vLLM's priority.
    "real": {"sim": SimOptions(max_num_seqs=8, default_max_tokens=32, models=("tiny-llama",)), "replicas": 2,
             "real": True, "rows": ("b", "a", "g", "h", "i")},
}
QUICK = dataclasses.replace(FULL, capacity_s=3, unloaded_s=8, overload_s=10, lead_in_s=1, rows=("a", "b", "c"),
                            min_interactive=0)


async def admission_counters(gateway_url: str) -> dict[str, float]:
    """The gateway's admission counters (dispatched, shed, preempted, wait sum and count) keyed by name and labels."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        samples = await metric_samples(session, gateway_url, _ADMISSION_METRICS)
    counters: dict[str, float] = {}
    for sample in samples:
        if sample.name.endswith(("_total", "_sum", "_count")):
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            counters[f"{sample.name.removeprefix('kvgate_admission_')}{{{labels}}}"] = sample.value
    return counters


@asynccontextmanager
async def _fleet(plan: Plan, name: str, sim: SimOptions, log_dir: Path) -> AsyncIterator[list[str]]:
    """The URLs of a fresh fleet run with `sim`: simulated, or real vLLM engines of its seats, model, scheduling."""
    if not plan.real:
        if plan.tokenized:
            sim = dataclasses.replace(sim, tokenizer=str(write_tiny_model(log_dir / name / "model")))
        async with running(start_sim_fleet(name, plan.replicas, sim, log_dir)) as urls:
            yield urls
        return
    python, model_dir = require_vllm_python("--fleet real"), write_tiny_model(log_dir / "model")
    specs = [EngineSpec(port=port, cpu=index % 2, model_dir=model_dir, served_model_name=sim.models[0],
                        max_num_seqs=sim.max_num_seqs, priority_scheduling=sim.priority_scheduling)
             for index, port in enumerate(free_ports(plan.replicas))]
    async with running_engines(specs, log_dir / name, python) as engines:
        yield [engine.url for engine in engines]


async def _run(plan: Plan, gateway_url: str, urls: list[str], key: str, title: str, rate: float, duration: float,
               batch_fraction: float, seed: int, body_for: BodyFor, lead_in_s: float = 0.0,
               batch: bool = True) -> RunResult:
    """One open-loop run through `gateway_url`, the queues sampled while the load is on; without `batch`, only
    the interactive requests of the same schedule are sent."""
    arrivals = [arrival for arrival in poisson_arrivals(rate, duration, batch_fraction, seed, lead_in_s)
                if batch or arrival.priority == INTERACTIVE]
    loop = asyncio.get_running_loop()
    load_end, queues = loop.time() + lead_in_s + duration, QueueSamples()
    probe: ReplicaProbe = VllmProbe() if plan.real else SimProbe()

    async def sample() -> None:
        if loop.time() < load_end:
            await queues.sample(session, gateway_url, urls, probe)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        async with sampling(_QUEUE_SAMPLE_SECONDS, sample):
            samples = await run_open_loop(gateway_url, arrivals, body_for, plan.drain_cap_s, plan.stall_s)
    counters = await admission_counters(gateway_url)
    offered = rate if batch else rate * (1 - batch_fraction)
    return summarise(key, title, offered, duration, samples, queues.summary(), counters, lead_in_s)


async def run_benchmark(plan: Plan, log_dir: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """Capacity probe, unloaded baseline, then each overload row on a fresh fleet; the report as plain JSON."""
    seats = plan.replicas * plan.sim.max_num_seqs
    async with _fleet(plan, "capacity-fleet", plan.sim, log_dir) as urls:
        measured = None if plan.capacity_rps else await measure_throughput(
            urls, 2 * seats, plan.capacity_warmup_s, plan.capacity_s, plan.body_for)
        capacity = plan.capacity_rps or measured or 0.0
        plan = plan.sized_for(capacity)
        progress(f"capacity: {'given' if plan.capacity_rps else 'measured'} {capacity:.1f} req/s, "
                 f"derived {plan.derived_capacity():.1f} req/s; runs of {plan.unloaded_s:.0f} s unloaded, "
                 f"{plan.overload_s:.0f} s overloaded")
        async with running(start_gateway("unloaded-kvgate", urls, ADMISSION.gateway_flags(plan.sim), log_dir)) as url:
            unloaded = await _run(plan, url, urls, "unloaded", f"{ADMISSION.title}, interactive only",
                                  plan.unloaded_fraction * capacity, plan.unloaded_s, 0.0, plan.seed, plan.body_for)
    progress(f"unloaded: interactive TTFT p50 {unloaded.interactive.ttft_p50_ms} ms "
             f"p99 {unloaded.interactive.ttft_p99_ms} ms")
    runs: list[RunResult] = []
    for key in plan.rows:
        row = ROWS[key]
        fleet = _fleet(plan, f"row-{key}-fleet", row.sim_options(plan.sim), log_dir)
        async with fleet as urls, running(start_gateway(f"row-{key}-kvgate", urls, row.gateway_flags(plan.sim),
                                                        log_dir)) as url:
            run = await _run(plan, url, urls, key, row.title, plan.overload_factor * capacity, plan.overload_s,
                             plan.batch_fraction, plan.seed + 1,
                             functools.partial(plan.body_for, batch_stream=row.batch_stream), plan.lead_in_s,
                             row.batch)
        runs.append(run)
        progress(f"row {key}: interactive TTFT p99 {run.interactive.ttft_p99_ms} ms, batch ok {run.batch.ok} "
                 f"shed {run.batch.shed} lost {run.interactive.lost + run.batch.lost}, wall {run.wall_s} s, replica "
                 f"queue mean {run.queues['replica_waiting_mean']}")
    fifo = next((run for run in runs if run.key == FIFO.key), None)
    return {
        "plan": plan.to_json(),
        "capacity": {"rps": round(capacity, 1), "measured_rps": None if measured is None else round(measured, 1),
                     "derived_rps": round(plan.derived_capacity(), 1), "seats": seats},
        "unloaded": unloaded.to_json(),
        "runs": [run.to_json() for run in runs],
        "verdicts": [verdict(run, unloaded, fifo, ROWS[run.key].batch_stream) for run in runs
                     if ROWS[run.key].judged],
        "without_batch": next((run.key for run in runs if not ROWS[run.key].batch), None),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Rows, the other runs' lengths and the fleet (--duration is each overload run's; without --quick a run lasts
    until it has sent Plan.min_interactive interactive requests)."""
    parser.add_argument("--rows", help=f"comma-separated rows to run, of {','.join(ROWS)} (--quick: a-c)")
    parser.add_argument("--unloaded-duration", type=float,
                        help=f"seconds of the unloaded run (without --quick, at least as long as "
                             f"{FULL.min_interactive} interactive requests take to send, as is each overload run)")
    parser.add_argument("--capacity-duration", type=float, help="seconds the capacity probe measures")
    parser.add_argument("--capacity", type=float, metavar="RPS",
                        help="the fleet's capacity in requests/s, instead of probing it: loads are multiples of it, "
                             "so runs of different code (or days) meet the same load")
    parser.add_argument("--replicas", type=int, help="simulated replicas")
    parser.add_argument("--fleet", choices=sorted(FLEETS), default="seats32",
                        help="the fleet's binding limit: seats (32 each), the KV cache (kv-bound-tokenized: engines "
                             "that tokenize at about 2.2 characters a token; kv-bound-chat: prompts that open with one "
                             "of 24 tenants' system prompts), or compute (256 seats); or 2 real vLLM "
                             "engines of 8 seats (needs $KVGATE_VLLM_PYTHON, ./dev real sets it up)")


def plan_from(options: argparse.Namespace) -> Plan:
    """The preset the flags pick, with the flags' overrides; BadOption naming an unknown row."""
    overrides = {"rows": tuple(options.rows.split(",")) if options.rows else None, "overload_s": options.duration,
                 "unloaded_s": options.unloaded_duration, "capacity_s": options.capacity_duration,
                 "replicas": options.replicas, "seed": options.seed, "capacity_rps": options.capacity}
    preset = dataclasses.replace(QUICK if options.quick else FULL, **FLEETS[options.fleet])
    plan = dataclasses.replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    if plan.capacity_rps is not None and plan.capacity_rps <= 0:
        raise BadOption(f"--capacity must be > 0 requests/s, got {plan.capacity_rps}")
    unknown = [key for key in plan.rows if key not in ROWS]
    if unknown:
        raise BadOption(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    return plan


def run(options: argparse.Namespace) -> int:
    """Run every row, write priority.{json,md} and the docs section, print the Markdown."""
    plan = plan_from(options)
    meta = RunMeta()
    report = asyncio.run(run_benchmark(plan, options.out / "logs", print))
    report["meta"] = meta.finish(command=options.command)
    section = "priority" if options.fleet == "seats32" else f"priority-{options.fleet}"
    publish(options.out, section, report, render_markdown(report), options.docs)
    return 0
