"""Per-row figures (hit rate, latency percentiles, throughput, balance) and the targets each row must meet."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.loadtest.kit.stats import percentile, spread
from kvgate.loadtest.routing.results import EXTERNAL, ORACLE, PRESSURE_ORACLE, RowPlan, RowRun, ScenarioRun

HIT_SHARE_OF_ORACLE = 0.95
PRECISE_SHARE_OF_PRESSURE_ORACLE = 0.97
PRECISE_POINTS_OVER_APPROXIMATE = 0.10
HIT_POINTS_OVER_BASELINE = 0.40
MAX_OVER_MEAN_REQUESTS = 1.25
GATEWAY_SCALE_OUT_LOSS = 0.02


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
    evictions: int | None  # None where the replicas do not count them (vLLM exports no eviction counter)
    decisions: dict[str, int] = field(default_factory=dict)  # kvgate rows: routing decisions by reason
    failure: str | None = None  # why the row could not run
    targets: list[TargetCheck] = field(default_factory=list)
    runs: int = 1
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)  # figure -> (lowest, highest) over the runs


def summarise_row(row: RowRun, oracle_hit_rate: float | None) -> RowSummary:
    """Figures from a row's client samples and its replicas' counters."""
    ok = [sample for sample in row.samples if sample.error is None]
    ttfts = [sample.ttft for sample in ok if sample.ttft is not None]
    e2es = [sample.e2e for sample in ok]
    per_replica = [int(stats["requests"]) for stats in row.replica_stats]
    total = sum(per_replica)
    mean = total / len(per_replica) if per_replica else 0.0
    # From the first request's start to the last one's end: a load generator's own start-up is no traffic.
    span = max((s.start + s.e2e for s in row.samples), default=0.0) - min((s.start for s in row.samples), default=0.0)
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
        evictions=row.replica_total("evictions") if all("evictions" in s for s in row.replica_stats) else None,
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


def _check_row(plan: RowPlan, row: RowSummary, rows: dict[str, RowSummary], baseline: str, skewed: bool,
               peer: str | None) -> list[TargetCheck]:
    """The targets of a routed row, against the oracle, the round-robin baseline, the peer router and its one-gateway
    twin."""
    oracle, rr = rows.get(ORACLE), rows.get(baseline)
    oracle_hit = oracle.hit_rate if oracle else None
    rr_hit = rr.hit_rate if rr else None
    checks = [
        _at_least("hit >= 95% of oracle", row.hit_rate,
                  None if oracle_hit is None else HIT_SHARE_OF_ORACLE * oracle_hit, "%"),
        _at_least("hit >= round-robin + 40 pts", row.hit_rate,
                  None if rr_hit is None else rr_hit + HIT_POINTS_OVER_BASELINE),
    ]
    if peer is not None and plan.kind != EXTERNAL:
        other = rows.get(peer)
        checks.append(_at_least(f"hit >= {peer}'s", row.hit_rate, other.hit_rate if other else None))
        checks.append(_at_most(f"TTFT p99 <= {peer}'s", row.ttft_p99, other.ttft_p99 if other else None, "ms"))
    if skewed:
        checks.append(_at_most("max/mean requests <= 1.25", row.max_over_mean, MAX_OVER_MEAN_REQUESTS, "x"))
        checks.append(_at_most("TTFT p99 <= round-robin's", row.ttft_p99, rr.ttft_p99 if rr else None, "ms"))
    if plan.precise:
        checks += _precise_checks(row, rows)
    if plan.gateways > 1:
        # Single-gateway kvgate rows are named after their policy (and mode).
        single = rows.get(f"{plan.policy} precise" if plan.precise else plan.policy or "")
        single_hit = single.hit_rate if single else None
        checks.append(_at_least(f"hit >= 1 gateway - {GATEWAY_SCALE_OUT_LOSS * 100:.0f} pts", row.hit_rate,
                                None if single_hit is None else single_hit - GATEWAY_SCALE_OUT_LOSS))
    return checks


def _precise_checks(row: RowSummary, rows: dict[str, RowSummary]) -> list[TargetCheck]:
    """Precise routing against the pressure oracle and against the approximate cache-aware row."""
    pressure, approximate = rows.get(PRESSURE_ORACLE), rows.get("cache-aware")
    pressure_hit = pressure.hit_rate if pressure else None
    approximate_hit = approximate.hit_rate if approximate else None
    return [
        _at_least(f"hit >= {PRECISE_SHARE_OF_PRESSURE_ORACLE:.0%} of pressure oracle", row.hit_rate,
                  None if pressure_hit is None else PRECISE_SHARE_OF_PRESSURE_ORACLE * pressure_hit, "%"),
        _at_least(f"hit >= approximate + {PRECISE_POINTS_OVER_APPROXIMATE * 100:.0f} pts", row.hit_rate,
                  None if approximate_hit is None else approximate_hit + PRECISE_POINTS_OVER_APPROXIMATE),
    ]


# Figures that vary from run to run: a row of repeated runs reports their median and range.
_VARYING = ("hit_rate", "hit_share_of_oracle", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "requests_per_second",
            "output_tokens_per_second", "max_over_mean")


def combine_runs(runs: Sequence[RowSummary]) -> RowSummary:
    """One row from its repeated runs: each varying figure's median and range, counts summed over the runs."""
    if len(runs) == 1:
        return runs[0]
    medians: dict[str, float | None] = {}
    ranges: dict[str, tuple[float, float]] = {}
    for name in _VARYING:
        found = spread([getattr(run, name) for run in runs])
        medians[name] = None if found is None else found[0]
        if found is not None:
            ranges[name] = found[1:]
    per_replica = [sum(counts) for counts in zip(*(run.replica_requests for run in runs), strict=True)]
    total = sum(per_replica)
    decisions: dict[str, int] = {}
    for run in runs:
        for reason, count in run.decisions.items():
            decisions[reason] = decisions.get(reason, 0) + count
    return dataclasses.replace(
        runs[0], **medians, requests=sum(r.requests for r in runs), errors=sum(r.errors for r in runs),
        replica_requests=per_replica, replica_shares=[count / total for count in per_replica] if total else [],
        preemptions=sum(r.preemptions for r in runs), decisions=decisions, runs=len(runs), ranges=ranges,
        failure=next((r.failure for r in runs if r.failure is not None), None),
        evictions=None if any(r.evictions is None for r in runs) else sum(r.evictions or 0 for r in runs))


def summarise_scenario(scenario: ScenarioRun, peer: str | None = None) -> list[RowSummary]:
    """Every row's figures (over its runs), with target checks on each routed row but the baseline and the peer."""
    by_plan: dict[str, list[RowRun]] = {}
    for row in scenario.rows:
        by_plan.setdefault(row.plan.name, []).append(row)
    oracle_runs = next((runs for runs in by_plan.values() if runs[0].plan.kind == ORACLE), [])
    summaries = [combine_runs([summarise_row(row, oracle_runs[n].hit_rate if n < len(oracle_runs) else None)
                               for n, row in enumerate(runs)]) for runs in by_plan.values()]
    by_name = {summary.name: summary for summary in summaries}
    plans = [runs[0].plan for runs in by_plan.values()]
    baseline = next((plan.name for plan in plans if plan.is_baseline), "")
    for plan, summary in zip(plans, summaries, strict=True):
        if plan.kind not in (ORACLE, PRESSURE_ORACLE) and not plan.is_baseline and plan.name != peer \
                and summary.failure is None:
            summary.targets = _check_row(plan, summary, by_name, baseline, scenario.skewed, peer)
    return summaries
