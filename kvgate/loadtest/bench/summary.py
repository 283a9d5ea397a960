"""Per-row figures (hit rate, latency percentiles, throughput, balance) and the targets each row must meet."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.loadtest.bench.results import KVGATE, ORACLE, RowPlan, RowRun, ScenarioRun

HIT_SHARE_OF_ORACLE = 0.95
SKEWED_HIT_POINTS_OVER_BASELINE = 0.25
MAX_OVER_MEAN_REQUESTS = 1.25
SKEWED_E2E_P99_OVER_BASELINE = 1.05
GATEWAY_SCALE_OUT_LOSS = 0.02


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of sorted `values`, interpolating linearly; None for no values."""
    if not values:
        return None
    position = (len(values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class TargetCheck:
    """One target a row was held to, and whether it met it."""

    name: str
    passed: bool
    detail: str


@dataclass(slots=True)
class RowSummary:
    """The figures of one row of the report; times in seconds, rates and shares as fractions."""

    name: str
    kind: str
    requests: int
    errors: int
    hit_rate: float | None
    hit_share_of_oracle: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    requests_per_second: float
    output_tokens_per_second: float
    replica_requests: list[int]
    max_over_mean: float | None
    replica_shares: list[float]
    preemptions: int
    evictions: int
    decisions: dict[str, int] = field(default_factory=dict)  # kvgate rows: routing decisions by reason
    failure: str | None = None  # why the row could not run
    targets: list[TargetCheck] = field(default_factory=list)


def summarise_row(row: RowRun, oracle_hit_rate: float | None) -> RowSummary:
    """Figures from a row's client samples and its replicas' counters."""
    ok = [sample for sample in row.samples if sample.error is None]
    ttfts = sorted(sample.ttft for sample in ok if sample.ttft is not None)
    e2es = sorted(sample.e2e for sample in ok)
    per_replica = [int(stats["requests"]) for stats in row.replica_stats]
    total = sum(per_replica)
    mean = total / len(per_replica) if per_replica else 0.0
    # From the first request's start to the last one's end: a load generator's own start-up is no traffic.
    span = max((sample.start + sample.e2e for sample in row.samples), default=0.0) - min(
        (sample.start for sample in row.samples), default=0.0)
    wall = span or row.wall_seconds or float("inf")
    hit_rate = row.hit_rate
    return RowSummary(
        name=row.plan.name,
        kind=row.plan.kind,
        requests=len(row.samples),
        errors=row.errors,
        hit_rate=hit_rate,
        hit_share_of_oracle=hit_rate / oracle_hit_rate if hit_rate is not None and oracle_hit_rate else None,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        e2e_p50=percentile(e2es, 50),
        e2e_p99=percentile(e2es, 99),
        requests_per_second=len(ok) / wall,
        output_tokens_per_second=row.replica_total("generation_tokens") / wall if row.replica_stats else 0.0,
        replica_requests=per_replica,
        max_over_mean=max(per_replica) / mean if mean else None,
        replica_shares=[count / total for count in per_replica] if total else [],
        preemptions=row.replica_total("preemptions") if row.replica_stats else 0,
        evictions=row.replica_total("evictions") if row.replica_stats else 0,
        decisions=row.decisions,
        failure=row.error,
    )


def _at_least(name: str, value: float | None, threshold: float | None, unit: str = "pts") -> TargetCheck:
    if value is None or threshold is None:
        return TargetCheck(name, False, "not measured")
    scale = 100 if unit in ("pts", "%") else 1
    return TargetCheck(name, value >= threshold, f"{value * scale:.1f} vs >= {threshold * scale:.1f} {unit}")


def _at_most(name: str, value: float | None, threshold: float | None, unit: str) -> TargetCheck:
    if value is None or threshold is None:
        return TargetCheck(name, False, "not measured")
    scale = 1000 if unit == "ms" else 1
    return TargetCheck(name, value <= threshold, f"{value * scale:.2f} vs <= {threshold * scale:.2f} {unit}")


def _check_row(plan: RowPlan, row: RowSummary, rows: dict[str, RowSummary], baseline: str, peer: str,
               skewed: bool) -> list[TargetCheck]:
    """A kvgate row's targets, against the oracle, the round-robin baseline, the peer router and its one-gateway twin."""
    oracle, rr, other = rows.get(ORACLE), rows.get(baseline), rows.get(peer)

    def of(summary: RowSummary | None, name: str) -> float | None:
        return getattr(summary, name) if summary is not None else None

    peer_hit = TargetCheck(f"hit >= {peer}'s", False, "not measured") if other is None else \
        _at_least(f"hit >= {peer}'s", row.hit_rate, other.hit_rate)
    if skewed:
        rr_hit, rr_e2e = of(rr, "hit_rate"), of(rr, "e2e_p99")
        checks = [
            _at_most(f"max/mean requests <= {MAX_OVER_MEAN_REQUESTS}", row.max_over_mean, MAX_OVER_MEAN_REQUESTS, "x"),
            _at_most("TTFT p99 <= round-robin's", row.ttft_p99, of(rr, "ttft_p99"), "ms"),
            _at_most("E2E p99 <= round-robin's + 5 %", row.e2e_p99,
                     None if rr_e2e is None else SKEWED_E2E_P99_OVER_BASELINE * rr_e2e, "ms"),
            _at_least(f"hit >= round-robin + {SKEWED_HIT_POINTS_OVER_BASELINE * 100:.0f} pts", row.hit_rate,
                      None if rr_hit is None else rr_hit + SKEWED_HIT_POINTS_OVER_BASELINE),
            peer_hit,
        ]
    else:
        oracle_hit = of(oracle, "hit_rate")
        checks = [
            peer_hit,
            _at_most(f"TTFT p99 <= {peer}'s", row.ttft_p99, of(other, "ttft_p99"), "ms"),
            _at_most("TTFT p99 <= round-robin's", row.ttft_p99, of(rr, "ttft_p99"), "ms"),
            _at_least("hit >= 95% of oracle", row.hit_rate,
                      None if oracle_hit is None else HIT_SHARE_OF_ORACLE * oracle_hit, "%"),
        ]
    if plan.gateways > 1:
        # Single-gateway kvgate rows are named after their policy.
        single_hit = of(rows.get(plan.policy or ""), "hit_rate")
        checks.append(_at_least(f"hit >= 1 gateway - {GATEWAY_SCALE_OUT_LOSS * 100:.0f} pts", row.hit_rate,
                                None if single_hit is None else single_hit - GATEWAY_SCALE_OUT_LOSS))
    return checks


def summarise_scenario(scenario: ScenarioRun, peer: str) -> list[RowSummary]:
    """Every row's figures, with target checks on each kvgate row but the baseline (external routers are the peers)."""
    oracle_hit = next((row.hit_rate for row in scenario.rows if row.plan.kind == ORACLE), None)
    summaries = [summarise_row(row, oracle_hit) for row in scenario.rows]
    by_name = {summary.name: summary for summary in summaries}
    baseline = next((row.plan.name for row in scenario.rows if row.plan.is_baseline), "")
    for row, summary in zip(scenario.rows, summaries, strict=True):
        if row.plan.kind == KVGATE and not row.plan.is_baseline and row.error is None:
            summary.targets = _check_row(row.plan, summary, by_name, baseline, peer, scenario.skewed)
    return summaries
