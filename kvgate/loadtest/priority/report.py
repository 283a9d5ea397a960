"""What a priority run saw: where requests waited, per class outcomes and latencies, the verdict, and the report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvgate.loadtest.kit.counters import ReplicaProbe
from kvgate.loadtest.kit.report import table
from kvgate.loadtest.kit.stats import ms
from kvgate.loadtest.priority.client import BATCH, INTERACTIVE, Outcome, Sample

TTFT_RATIO_LIMIT = 2.0  # interactive TTFT p99 under overload against unloaded: the target
TTFT_RATIO_AIM = 1.5
# Batch throughput against FIFO's (issue 16): 0.95 where batch reads whole answers, 0.9 where it streams and seats
# must be held back for interactive requests.
BATCH_THROUGHPUT_TARGET = 0.95
STREAMED_BATCH_THROUGHPUT_TARGET = 0.9


@dataclass(slots=True)
class QueueSamples:
    """Where requests wait while the load is on: inside the replicas (their probe's stats), in kvgate's queue, stale
    scrapes; and how full the replicas run (sequences running, KV cache use) and what their engines counted."""

    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    kv_use: list[float] = field(default_factory=list)
    gateway_queue: list[int] = field(default_factory=list)
    stale: list[bool] = field(default_factory=list)
    engine: dict[str, float] = field(default_factory=dict)  # the engines' counters at the last sample, summed

    async def sample(self, session: aiohttp.ClientSession, gateway_url: str, replica_urls: Sequence[str],
                     probe: ReplicaProbe) -> None:
        """One sample of every replica and of kvgate's /debug/fleet."""
        stats = await probe.stats(session, replica_urls)
        async with session.get(gateway_url + "/debug/fleet") as response:
            fleet = await response.json()
        self.waiting += [int(replica["waiting"]) for replica in stats]
        self.running += [int(replica["running"]) for replica in stats]
        self.kv_use += [float(replica["kv_cache_usage"]) for replica in stats]
        self.engine = {name: sum(float(replica.get(name, 0)) for replica in stats) for name in _ENGINE_COUNTERS}
        self.gateway_queue.append(int(fleet["queue"]["waiting"]))
        self.stale += [bool(endpoint["metrics"]["stale"]) for endpoint in fleet["endpoints"]]

    def summary(self) -> dict[str, Any]:
        """Samples taken, replica queue mean (per replica) and max, running sequences and KV cache use per replica
        (means), kvgate's queue max, the share of (sample, replica) pairs judged on stale metrics (headroom then counts
        only what was sent since the last good scrape), the engines' preemptions and the share of prompt tokens their
        prefix caches held, from the start of the run to the last sample."""
        queries = self.engine.get("prefix_cache_queries", 0.0)
        return {"samples": len(self.gateway_queue),
                "replica_waiting_mean": _mean(self.waiting),
                "replica_waiting_max": max(self.waiting, default=0),
                "replica_running_mean": _mean(self.running),
                "replica_kv_use_mean": _mean(self.kv_use, 2),
                "engine_preemptions": int(self.engine.get("preemptions", 0)),
                "prompt_cached": round(self.engine.get("prefix_cache_hits", 0.0) / queries, 3) if queries else None,
                "gateway_queue_max": max(self.gateway_queue, default=0),
                "stale_fraction": round(sum(self.stale) / len(self.stale), 3) if self.stale else 0.0}


_ENGINE_COUNTERS = ("preemptions", "prefix_cache_hits", "prefix_cache_queries")


def _mean(values: Sequence[float], digits: int = 1) -> float:
    return round(statistics.fmean(values), digits) if values else 0.0


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
                   ms(ttfts, 50), ms(ttfts, 99), ms([s.e2e for s in ok if s.e2e is not None], 99), problem)


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
    queues: dict[str, Any]  # QueueSamples.summary()
    gateway: dict[str, float] = field(default_factory=dict)

    @property
    def batch_throughput(self) -> float:
        """Batch requests completed per second of the run including its drain."""
        return self.batch.ok / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        """The result as plain JSON, with the derived throughput, preemptions and interactive wait in kvgate."""
        count = self.gateway.get(f"wait_seconds_count{{priority_class={INTERACTIVE}}}", 0.0)
        wait_s = self.gateway.get(f"wait_seconds_sum{{priority_class={INTERACTIVE}}}", 0.0) / count if count else 0.0
        return {**asdict(self), "batch_throughput": round(self.batch_throughput, 2),
                "batch_preempted": int(self.gateway.get(f"preempted_total{{priority_class={BATCH}}}", 0.0)),
                "interactive_kvgate_wait_ms": round(1000 * wait_s, 1)}


def summarise(key: str, title: str, offered_rps: float, duration_s: float, samples: Sequence[Sample],
              queues: dict[str, Any], gateway: dict[str, float], lead_in_s: float = 0.0) -> RunResult:
    """Build a run's result from its samples; times count from the flood's start, `lead_in_s` into the run."""
    ends = [s.finished_at - lead_in_s for s in samples if s.finished_at is not None]
    return RunResult(
        key, title, round(offered_rps, 1), duration_s, round(max(ends, default=duration_s), 2),
        ClassStats.of([s for s in samples if s.priority == INTERACTIVE]),
        ClassStats.of([s for s in samples if s.priority == BATCH]), ms([s.lag for s in samples], 99), queues, gateway)


def verdict(run: RunResult, unloaded: RunResult, fifo: RunResult | None, batch_streamed: bool) -> dict[str, Any]:
    """Judge a row with admission control: interactive TTFT p99 against unloaded, every request answered (200 or
    429), batch throughput against the FIFO row's (a lower target where batch streams)."""
    base = unloaded.interactive.ttft_p99_ms
    ratio = run.interactive.ttft_p99_ms / base if base > 0 else float("inf")
    answered = all(stats.errors == 0 and stats.lost == 0 for stats in (run.interactive, run.batch))
    batch_ratio = run.batch_throughput / fifo.batch_throughput if fifo and fifo.batch_throughput > 0 else float("nan")
    target = STREAMED_BATCH_THROUGHPUT_TARGET if batch_streamed else BATCH_THROUGHPUT_TARGET
    ttft_ok, batch_ok = ratio <= TTFT_RATIO_LIMIT, fifo is None or batch_ratio >= target
    return {"key": run.key, "ttft_ratio": round(ratio, 2), "ttft_ok": ttft_ok, "all_answered": answered,
            "batch_ratio": round(batch_ratio, 3), "batch_target": target, "batch_ok": batch_ok,
            "passed": ttft_ok and answered and batch_ok}


def _mark(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _counts(stats: dict[str, Any]) -> str:
    return f"{stats['ok']} / {stats['shed']} / {stats['errors']} / {stats['lost']}"


_HEADER = ("run", "interactive TTFT p50 / p99 (ms)", "p99 vs unloaded", "interactive e2e p99 (ms)",
           "interactive ok / 429 / err / lost", "batch ok / 429 / err / lost", "batch req/s", "batch preempted",
           "replica queue mean / max", "replica running / KV use mean", "engine preemptions",
           "prompt tokens cached", "kvgate queue max", "interactive mean wait in kvgate (ms)", "stale scrapes")


def _row(run: dict[str, Any], base: float) -> tuple[str, ...]:
    """One run: interactive latency, outcomes of both classes, batch throughput, where requests waited."""
    inter, queues = run["interactive"], run["queues"]
    name = run["key"] if run["key"] == "unloaded" else f"({run['key']})"
    return (f"{name} {run['title']}, {run['offered_rps']} req/s",
            f"{inter['ttft_p50_ms']:.0f} / {inter['ttft_p99_ms']:.0f}",
            f"{inter['ttft_p99_ms'] / base if base else float('inf'):.1f}x", f"{inter['e2e_p99_ms']:.0f}",
            _counts(inter), _counts(run["batch"]), f"{run['batch_throughput']:.1f}", str(run["batch_preempted"]),
            f"{queues['replica_waiting_mean']} / {queues['replica_waiting_max']}",
            f"{queues['replica_running_mean']} / {queues['replica_kv_use_mean']}", str(queues["engine_preemptions"]),
            _share(queues["prompt_cached"]),
            str(queues["gateway_queue_max"]),
            f"{run['interactive_kvgate_wait_ms']:.0f}", f"{queues['stale_fraction']:.0%}")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: setup, capacity, the table, and pass/fail per target."""
    plan, capacity, meta = report["plan"], report["capacity"], report["meta"]
    sim = plan["sim"]
    base = report["unloaded"]["interactive"]["ttft_p99_ms"]
    real = plan.get("real", False)
    fleet = (f"{plan['replicas']} real vLLM engines (the CPU build, one per core, the tiny model of tests/real with "
             f"dummy weights), max_num_seqs {sim['max_num_seqs']}" if real else
             f"{plan['replicas']} simulated replicas (`kvgate sim`), max_num_seqs {sim['max_num_seqs']}, speed "
             f"{sim['speed']}, decode step {sim['decode_step_seconds']} s + {sim['decode_seconds_per_seq']} s per "
             "running sequence")
    queue_source = "vLLM's num_requests_waiting" if real else "`/sim/stats`"
    lengthened = (f" Each run lasts at least until it has sent {plan['min_interactive']} interactive requests, so "
                  "that a p99 is not merely the slowest request." if plan.get("min_interactive") else "")
    derived = ("" if real else f"; {capacity['derived_rps']} req/s from the simulator's timing model (the difference "
               "is CPU contention on this machine)")
    lines = [
        "### Priority classes under overload",
        "",
        f"Measured {meta['date']} by `{meta['command']}` on {meta['cpus']} CPUs; the fleet, kvgate and "
        f"the load generator share them (1-minute load average before/after: {meta['loadavg_1m'][0]}/"
        f"{meta['loadavg_1m'][1]}). Fleet: {fleet}; every request is a chat completion of "
        f"{plan['max_tokens'] // 2} to {plan['max_tokens'] * 3 // 2} tokens (uniform, mean {plan['max_tokens']}) "
        f"{_prompts(plan)}; interactive requests stream, batch requests read whole answers "
        "as batch jobs do (streamed in row f).",
        "",
        (f"Capacity: {capacity['measured_rps']} req/s measured (closed loop, {2 * capacity['seats']} requests "
         f"always open directly against the replicas, {plan['capacity_s']} s after a {plan['capacity_warmup_s']} s "
         f"warm-up, the longest request's time){derived}. Loads below are multiples of the measured value."
         if capacity["measured_rps"] is not None else
         f"Capacity: {capacity['rps']} req/s as given (`--capacity`, not probed){derived}. Loads below are "
         "multiples of it."),
        "",
        f"Load: open loop, Poisson arrivals, each run on a fresh fleet and gateway. Unloaded: interactive only at "
        f"{plan['unloaded_fraction']:.0%} of capacity for {plan['unloaded_s']} s. Overload: {plan['overload_factor']}x "
        f"capacity, {plan['batch_fraction']:.0%} batch (`x-priority: batch`), for {plan['overload_s']} s, after "
        f"{plan['lead_in_s']} s of its interactive share alone (the flood lands on interactive traffic already "
        f"flowing), then until open requests finish: while one ends at least every "
        f"{plan['stall_s']:.0f} s, for at most {plan['drain_cap_s']:.0f} s (a request still open then counts "
        f"as lost).{lengthened} TTFT is the time to the first content chunk, of requests sent during the "
        f"flood; every request counts in ok / 429 / err / lost. Batch req/s counts completed batch requests from the "
        f"flood's start to the end of its drain; batch preempted counts the times kvgate took a batch request's seat "
        f"back for an interactive one (it then queued again). Replica queue: requests waiting inside the replicas "
        f"({queue_source}), replica running / KV use: sequences running and KV cache use per replica, engine "
        f"preemptions: the engines' own (out of KV blocks, vLLM preempts and recomputes), prompt tokens cached: the "
        f"share of prompt tokens the engines' prefix caches held (engine counters to the last sample), kvgate queue: "
        f"its admission queue, stale scrapes: share of samples where kvgate judged a "
        f"replica on stale metrics (headroom then counts only what was sent since the last good scrape); all "
        f"sampled every 0.5 s while the load was on.",
        "",
        *table(_HEADER, [_row(run, base) for run in [report["unloaded"], *report["runs"]]]),
        "",
    ]
    for v in report["verdicts"]:  # each target for each run with admission control
        lines.append(
            f"- ({v['key']}) {_mark(v['passed'])}: interactive TTFT p99 {v['ttft_ratio']}x unloaded "
            f"(target <= {TTFT_RATIO_LIMIT}x, aim {TTFT_RATIO_AIM}x) {_mark(v['ttft_ok'])}; every request answered "
            f"(200 or 429) {_mark(v['all_answered'])}; batch throughput {v['batch_ratio']}x FIFO's (b) "
            f"(target >= {v.get('batch_target', BATCH_THROUGHPUT_TARGET)}) {_mark(v['batch_ok'])}.")
    if alone := _without_batch_note(report, base):
        lines.append(alone)
    return "\n".join(lines) + "\n"


def _prompts(plan: dict[str, Any]) -> str:
    """What the requests' prompts share: nothing, or their tenants' system prompts."""
    if not plan.get("tenants"):
        return "with its own prompt (no prefix reuse)"
    return (f"whose prompt opens with the system prompt of one of {plan['tenants']} tenants (about "
            f"{plan['system_prompt_chars']} characters each, the tenant drawn at random per request, both classes "
            f"alike) and ends in its own question of {plan['prompt_words']} words")


def _without_batch_note(report: dict[str, Any], base: float) -> str:
    """What the row without batch says: what the flood's interactive requests get alone, and each judged row's p99
    against it; empty without that row."""
    runs = {run["key"]: run for run in report["runs"]}
    alone = runs.get(report.get("without_batch") or "")
    if alone is None:
        return ""
    p99 = alone["interactive"]["ttft_p99_ms"]
    judged = "; ".join(f"({v['key']}) {runs[v['key']]['interactive']['ttft_p99_ms'] / p99:.2f}x"
                       for v in report["verdicts"]) or "none ran"
    return (f"- ({alone['key']}) without batch: the flood's interactive requests alone reached TTFT p99 {p99:.0f} ms, "
            f"{p99 / base if base else float('inf'):.2f}x unloaded. The judged rows' p99 against it: {judged}.")
