"""The priority benchmark's Markdown report."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvgate.loadtest.kit.counters import read_stats
from kvgate.loadtest.kit.stats import percentile
from kvgate.loadtest.priority.client import BATCH, INTERACTIVE, Outcome, Sample

SAMPLE_INTERVAL_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class QueueSummary:
    """Queue depths seen while the load was on."""

    samples: int
    replica_waiting_mean: float  # per replica, from /sim/stats (ground truth)
    replica_waiting_max: int
    gateway_queue_max: int  # kvgate's admission queue, all classes
    stale_fraction: float  # of (sample, replica) pairs kvgate judged on stale metrics (headroom then counts only what was sent since the last good scrape)


@dataclass(slots=True)
class QueueProbe:
    """Polls /sim/stats of every replica and kvgate's /debug/fleet until stopped."""

    gateway_url: str
    replica_urls: Sequence[str]
    waiting: list[int] = field(default_factory=list)
    gateway_queue: list[int] = field(default_factory=list)
    stale: list[bool] = field(default_factory=list)

    async def run(self) -> None:
        """Sample until cancelled; a failed sample is skipped, not fatal."""
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    stats = await read_stats(session, self.replica_urls)
                    async with session.get(self.gateway_url + "/debug/fleet") as response:
                        fleet = await response.json()
                except (aiohttp.ClientError, TimeoutError):
                    stats = None
                if stats is not None:
                    self.waiting += [int(replica["waiting"]) for replica in stats]
                    self.gateway_queue.append(int(fleet["queue"]["waiting"]))
                    self.stale += [bool(endpoint["metrics"]["stale"]) for endpoint in fleet["endpoints"]]
                await asyncio.sleep(SAMPLE_INTERVAL_SECONDS)

    def summary(self) -> QueueSummary:
        """What the samples show."""
        return QueueSummary(
            len(self.gateway_queue),
            round(statistics.fmean(self.waiting), 1) if self.waiting else 0.0,
            max(self.waiting, default=0),
            max(self.gateway_queue, default=0),
            round(sum(self.stale) / len(self.stale), 3) if self.stale else 0.0,
        )


TTFT_RATIO_LIMIT = 2.0  # interactive TTFT p99 under overload against unloaded: the target
TTFT_RATIO_AIM = 1.5
BATCH_THROUGHPUT_TOLERANCE = 0.95  # run-to-run noise allowed before "no lower than FIFO" fails


def _ms(seconds: list[float], q: int) -> float:
    """The q-th percentile in milliseconds, to a tenth; 0 for none."""
    return round((percentile(seconds, q) or 0.0) * 1000, 1)


@dataclass(frozen=True, slots=True)
class ClassStats:
    """Outcomes and latencies of one priority class in one run; latencies in ms, of successful requests."""

    sent: int
    ok: int
    shed: int
    errors: int
    lost: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float
    first_problem: str = ""

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> ClassStats:
        """Summarise the samples of one class: every one counts, latencies only of those sent during the flood."""
        count = {outcome: sum(1 for s in samples if s.outcome is outcome) for outcome in Outcome}
        ok = [s for s in samples if s.outcome is Outcome.OK and not s.lead_in]
        ttfts = [s.ttft for s in ok if s.ttft is not None]
        problem = next((s.detail for s in samples if s.outcome in (Outcome.ERROR, Outcome.LOST)), "")
        return cls(len(samples), count[Outcome.OK], count[Outcome.SHED], count[Outcome.ERROR], count[Outcome.LOST],
                   _ms(ttfts, 50), _ms(ttfts, 99), _ms([s.e2e for s in ok if s.e2e is not None], 99), problem)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: its load, what each class saw, and how the gateway admitted requests."""

    key: str
    title: str
    offered_rps: float
    duration_s: float
    wall_s: float  # from the flood's start to the last answer (the run plus its drain)
    interactive: ClassStats
    batch: ClassStats
    send_lag_p99_ms: float  # how far the generator fell behind its schedule
    queues: QueueSummary
    gateway: dict[str, float] = field(default_factory=dict)

    @property
    def batch_throughput(self) -> float:
        """Batch requests completed per second of the run including its drain."""
        return self.batch.ok / self.wall_s if self.wall_s > 0 else 0.0

    def mean_kvgate_wait_ms(self, priority: str) -> float:
        """Mean time requests of a class spent in kvgate's admission queue (0 for those let straight through)."""
        labels = f"{{priority_class={priority}}}"
        count = self.gateway.get(f"wait_seconds_count{labels}", 0.0)
        return 1000 * self.gateway.get(f"wait_seconds_sum{labels}", 0.0) / count if count else 0.0

    @property
    def batch_preempted(self) -> int:
        """Times kvgate took a batch request's seat back for an interactive one and queued it again."""
        return int(self.gateway.get(f"preempted_total{{priority_class={BATCH}}}", 0.0))

    @property
    def lost(self) -> int:
        """Requests of either class that got no answer."""
        return self.interactive.lost + self.batch.lost

    def to_json(self) -> dict:
        """The result as plain JSON, with the derived throughput."""
        return {**asdict(self), "batch_throughput": round(self.batch_throughput, 2), "batch_preempted": self.batch_preempted,
                "interactive_kvgate_wait_ms": round(self.mean_kvgate_wait_ms(INTERACTIVE), 1)}


def summarise(key: str, title: str, offered_rps: float, duration_s: float, samples: Sequence[Sample],
              queues: QueueSummary, gateway: dict[str, float], lead_in_s: float = 0.0) -> RunResult:
    """Build a run's result from its samples; times count from the flood's start, `lead_in_s` into the run."""
    ends = [s.finished_at - lead_in_s for s in samples if s.finished_at is not None]
    return RunResult(
        key, title, round(offered_rps, 1), duration_s, round(max(ends, default=duration_s), 2),
        ClassStats.of([s for s in samples if s.priority == INTERACTIVE]),
        ClassStats.of([s for s in samples if s.priority == BATCH]),
        _ms([s.lag for s in samples], 99), queues, gateway,
    )


def ttft_ratio(run: RunResult, unloaded: RunResult) -> float:
    """Interactive TTFT p99 of a run against the unloaded baseline."""
    base = unloaded.interactive.ttft_p99_ms
    return run.interactive.ttft_p99_ms / base if base > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Each target for one row with admission control, against the FIFO row."""

    key: str
    ttft_ratio: float
    ttft_ok: bool
    all_answered: bool  # every request got a success or a 429
    batch_ratio: float  # batch throughput against FIFO's
    batch_ok: bool

    @property
    def passed(self) -> bool:
        """Whether every target is met."""
        return self.ttft_ok and self.all_answered and self.batch_ok


def verdict(run: RunResult, unloaded: RunResult, fifo: RunResult | None) -> Verdict:
    """Judge a row against the targets."""
    ratio = ttft_ratio(run, unloaded)
    answered = all(stats.errors == 0 and stats.lost == 0 for stats in (run.interactive, run.batch))
    batch_ratio = run.batch_throughput / fifo.batch_throughput if fifo and fifo.batch_throughput > 0 else float("nan")
    return Verdict(run.key, round(ratio, 2), ratio <= TTFT_RATIO_LIMIT, answered, round(batch_ratio, 3),
                   fifo is None or batch_ratio >= BATCH_THROUGHPUT_TOLERANCE)


def _mark(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _counts(stats: dict[str, Any]) -> str:
    return f"{stats['ok']} / {stats['shed']} / {stats['errors']} / {stats['lost']}"


def _table(report: dict[str, Any]) -> list[str]:
    """One line per run: interactive latency, outcomes of both classes, batch throughput, where requests waited."""
    base = report["unloaded"]["interactive"]["ttft_p99_ms"]
    lines = [
        "| run | interactive TTFT p50 / p99 (ms) | p99 vs unloaded | interactive e2e p99 (ms) "
        "| interactive ok / 429 / err / lost | batch ok / 429 / err / lost | batch req/s | batch preempted | replica queue mean / max "
        "| kvgate queue max | interactive mean wait in kvgate (ms) | stale scrapes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in [report["unloaded"], *report["runs"]]:
        inter, batch, queues = run["interactive"], run["batch"], run["queues"]
        ratio = inter["ttft_p99_ms"] / base if base else float("inf")
        name = run["key"] if run["key"] == "unloaded" else f"({run['key']})"
        lines.append(
            f"| {name} {run['title']}, {run['offered_rps']} req/s | {inter['ttft_p50_ms']:.0f} / "
            f"{inter['ttft_p99_ms']:.0f} | {ratio:.1f}x | {inter['e2e_p99_ms']:.0f} | {_counts(inter)} | "
            f"{_counts(batch)} | {run['batch_throughput']:.1f} | {run['batch_preempted']} | {queues['replica_waiting_mean']} / "
            f"{queues['replica_waiting_max']} | {queues['gateway_queue_max']} | "
            f"{run['interactive_kvgate_wait_ms']:.0f} | {queues['stale_fraction']:.0%} |")
    return lines


def _verdict_lines(report: dict[str, Any]) -> list[str]:
    """Each target for each run with admission control."""
    lines = []
    for v in report["verdicts"]:
        lines.append(
            f"- ({v['key']}) {_mark(v['passed'])}: interactive TTFT p99 {v['ttft_ratio']}x unloaded "
            f"(target <= {TTFT_RATIO_LIMIT}x, aim {TTFT_RATIO_AIM}x) {_mark(v['ttft_ok'])}; every request answered "
            f"(200 or 429) {_mark(v['all_answered'])}; batch throughput {v['batch_ratio']}x FIFO's (b) "
            f"(target >= {BATCH_THROUGHPUT_TOLERANCE}) {_mark(v['batch_ok'])}.")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: setup, capacity, the table, and pass/fail per target."""
    plan, capacity, meta = report["plan"], report["capacity"], report["meta"]
    sim = plan["sim"]
    lines = [
        "### Priority classes under overload",
        "",
        f"Measured {meta['date']} by `{meta['command']}` on {meta['cpus']} CPUs; the simulated fleet, kvgate and "
        f"the load generator share them (1-minute load average before/after: {meta['loadavg_1m'][0]}/"
        f"{meta['loadavg_1m'][1]}). Fleet: {plan['replicas']} simulated replicas (`kvgate sim`), "
        f"max_num_seqs {sim['max_num_seqs']}, speed {sim['speed']}, decode step {sim['decode_step_seconds']} s + "
        f"{sim['decode_seconds_per_seq']} s per running sequence; every request is a chat completion of "
        f"{plan['max_tokens'] // 2} to {plan['max_tokens'] * 3 // 2} tokens (uniform, mean {plan['max_tokens']}) "
        "with its own prompt (no prefix reuse); interactive requests stream, batch requests read whole answers "
        "as batch jobs do (streamed in row f).",
        "",
        f"Capacity: {capacity['measured_rps']} req/s measured (closed loop, {2 * capacity['seats']} requests "
        f"always open directly against the replicas, {plan['capacity_s']} s after a {plan['capacity_warmup_s']} s warm-up, "
        f"the longest request's time); {capacity['derived_rps']} req/s from the "
        f"simulator's timing model (the difference is CPU contention on this machine). Loads below are multiples "
        f"of the measured value.",
        "",
        f"Load: open loop, Poisson arrivals, each run on a fresh fleet and gateway. Unloaded: interactive only at "
        f"{plan['unloaded_fraction']:.0%} of capacity for {plan['unloaded_s']} s. Overload: {plan['overload_factor']}x "
        f"capacity, {plan['batch_fraction']:.0%} batch (`x-priority: batch`), for {plan['overload_s']} s, after "
        f"{plan['lead_in_s']} s of its interactive share alone (the flood lands on interactive traffic already "
        f"flowing), then up to {plan['drain_cap_s']:.0f} s for open requests to finish (a request still open then "
        f"counts as lost). TTFT is the time to the first content chunk, of requests sent during the flood; every "
        f"request counts in ok / 429 / err / lost. Batch req/s counts completed batch requests from the flood's "
        f"start to the end of its drain; batch preempted counts the times kvgate took a batch request's seat back for an "
        f"interactive one (it then queued again). Replica queue: requests waiting inside the replicas (`/sim/stats`), kvgate queue: its "
        f"admission queue, stale scrapes: share of samples where kvgate judged a replica on stale metrics "
        f"(headroom then counts only what was sent since the last good scrape); all sampled every 0.5 s while the load was on.",
        "",
        *_table(report),
        "",
        *_verdict_lines(report),
    ]
    return "\n".join(lines) + "\n"
