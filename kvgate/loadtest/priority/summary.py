"""Summaries of a run's samples: per class counts and latencies, per row throughput, and the verdict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvgate.loadtest.kit.stats import percentile
from kvgate.loadtest.priority.client import Outcome, Sample
from kvgate.loadtest.priority.probe import QueueSummary
from kvgate.loadtest.priority.workload import BATCH, INTERACTIVE

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
