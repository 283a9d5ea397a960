"""The routing benchmarks' rows, what each measured, the targets each is held to, and their report."""

from __future__ import annotations

import dataclasses
import os
import platform
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.loadtest.kit.counters import LoadSeries
from kvgate.loadtest.kit.report import code_version, describe_code, markers, table, write_docs_section
from kvgate.loadtest.kit.stats import percentile, spread
from kvgate.loadtest.kit.stream import RequestSample
from kvgate.simulator import SimOptions

ORACLE = "oracle"
PRESSURE_ORACLE = "pressure oracle"  # one replica with the whole fleet's cache (precise routing's ceiling)
KVGATE = "kvgate"
EXTERNAL = "external"
BASELINE_POLICY = "round-robin"
DOCS_START, DOCS_END = markers("routing")
HIT_SHARE_OF_ORACLE = 0.95
PRECISE_SHARE_OF_PRESSURE_ORACLE = 0.97
PRECISE_POINTS_OVER_APPROXIMATE = 0.10
SKEWED_HIT_POINTS_OVER_BASELINE = 0.25
SKEWED_E2E_P99_OVER_BASELINE = 1.05
MAX_OVER_MEAN_REQUESTS = 1.25
GATEWAY_SCALE_OUT_LOSS = 0.02


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One row of a scenario: what routes the traffic."""

    name: str
    kind: str  # ORACLE (straight to one unbounded replica), KVGATE or EXTERNAL
    policy: str | None = None  # kvgate policy
    gateways: int = 1  # kvgate processes sharing the traffic by client-side round robin
    template: str | None = None  # external router command line
    precise: bool = False  # kvgate routes on the replicas' KV events (tokenizing as they do)
    shared: bool = False  # the gateways share their routing decisions (kvgate serve --peer-listen / --peers)

    @property
    def is_baseline(self) -> bool:
        """Whether this is the round-robin row every other row is compared with."""
        return self.kind == KVGATE and self.policy == BASELINE_POLICY and self.gateways == 1


@dataclass(slots=True)
class RowRun:
    """The raw outcome of one row: client samples, the replicas' counters, their load over time."""

    plan: RowPlan
    samples: list[RequestSample] = field(default_factory=list)
    replica_stats: list[dict[str, Any]] = field(default_factory=list)
    load: LoadSeries = field(default_factory=LoadSeries)
    wall_seconds: float = 0.0
    error: str | None = None  # set when the row could not run at all
    decisions: dict[str, int] = field(default_factory=dict)  # kvgate rows: routing decisions by reason

    def replica_total(self, counter: str) -> int:
        """A `/sim/stats` counter summed over the row's replicas."""
        return sum(int(stats[counter]) for stats in self.replica_stats)

    @property
    def hit_rate(self) -> float | None:
        """Prefix cache hits over queries, in tokens, by the replicas' own counters; None without queries."""
        queries = self.replica_total("prefix_cache_queries")
        return self.replica_total("prefix_cache_hits") / queries if queries else None

    @property
    def errors(self) -> int:
        """Requests that failed or ended without completing."""
        return sum(sample.error is not None for sample in self.samples)


@dataclass(slots=True)
class ScenarioRun:
    """Every row of one load (uniform or Zipf chats, shared prefix, ...), each measured `runs` times in turn."""

    name: str
    description: str
    skewed: bool  # popularity is skewed: the balance targets apply
    fleet: SimOptions | None = None  # the simulated fleet's and the oracle's settings (None on real engines)
    oracle: SimOptions | None = None
    rows: list[RowRun] = field(default_factory=list)


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
    # prompt tokens missed by conversations' first turns and by their later turns, as shares of all prompt tokens,
    # from each answer's cached tokens (None where the answers do not report them)
    missed_first_turns: float | None
    missed_later_turns: float | None
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


def _shares(counts: list[int]) -> list[float]:
    return [count / sum(counts) for count in counts] if sum(counts) else []


def missed_by_turn(samples: Sequence[RequestSample]) -> tuple[float | None, float | None]:
    """Prompt tokens missed by first turns and by later turns, as shares of all the prompt tokens of the answers that
    told their cached tokens; (None, None) where none did."""
    told = [(sample.turn == 0, prompt, prompt - cached) for sample in samples
            if (prompt := sample.prompt_tokens) and (cached := sample.cached_tokens) is not None
            and sample.turn is not None]
    total = sum(prompt for _, prompt, _ in told)
    if not total:
        return None, None
    first = sum(missed for is_first, _, missed in told if is_first)
    return first / total, sum(missed for is_first, _, missed in told if not is_first) / total


def summarise_row(row: RowRun, oracle_hit_rate: float | None) -> RowSummary:
    """Figures from a row's client samples and its replicas' counters."""
    ok = [sample for sample in row.samples if sample.error is None]
    ttfts = [sample.ttft for sample in ok if sample.ttft is not None]
    per_replica = [int(stats["requests"]) for stats in row.replica_stats]
    mean = sum(per_replica) / len(per_replica) if per_replica else 0.0
    # From the first request's start to the last one's end: a load generator's own start-up is no traffic.
    span = max((s.start + s.e2e for s in row.samples), default=0.0) - min((s.start for s in row.samples), default=0.0)
    wall = span or row.wall_seconds or float("inf")
    hit_rate, stats = row.hit_rate, row.replica_stats
    missed_first, missed_later = missed_by_turn(ok)
    return RowSummary(
        name=row.plan.name, kind=row.plan.kind, requests=len(row.samples), errors=row.errors, hit_rate=hit_rate,
        hit_share_of_oracle=hit_rate / oracle_hit_rate if hit_rate is not None and oracle_hit_rate else None,
        missed_first_turns=missed_first, missed_later_turns=missed_later,
        ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
        e2e_p50=percentile([s.e2e for s in ok], 50), e2e_p99=percentile([s.e2e for s in ok], 99),
        requests_per_second=len(ok) / wall,
        output_tokens_per_second=row.replica_total("generation_tokens") / wall if stats else 0.0,
        replica_requests=per_replica, max_over_mean=max(per_replica) / mean if mean else None,
        replica_shares=_shares(per_replica), preemptions=row.replica_total("preemptions") if stats else 0,
        evictions=row.replica_total("evictions") if all("evictions" in s for s in stats) else None,
        decisions=row.decisions, failure=row.error,
    )  # fmt: skip


def _target(name: str, value: float | None, bound: float | None, unit: str, at_least: bool = True) -> TargetCheck:
    """`value` >= `bound` (or <=), shown in `unit` (pts and % as percentages, ms in milliseconds)."""
    if value is None or bound is None:
        return TargetCheck(name, False, "not measured")
    scale = {"pts": 100, "%": 100, "ms": 1000}.get(unit, 1)
    digits, sign = (1, ">=") if at_least else (2, "<=")
    passed = value >= bound if at_least else value <= bound
    return TargetCheck(name, passed, f"{value * scale:.{digits}f} vs {sign} {bound * scale:.{digits}f} {unit}")


def _hit(row: RowSummary | None, factor: float = 1.0, points: float = 0.0) -> float | None:
    """`factor` times a row's hit rate plus `points`; None for a missing row or one without a hit rate."""
    return None if row is None or row.hit_rate is None else factor * row.hit_rate + points


def _check_row(plan: RowPlan, row: RowSummary, rows: dict[str, RowSummary], baseline: str, skewed: bool,
               peer: str | None) -> list[TargetCheck]:
    """A routed row's targets (the routing issue's): against the oracle, the baseline, the peer router and its
    one-gateway twin."""
    rr = rows.get(baseline)
    checks = [_target("hit >= 95% of oracle", row.hit_rate, _hit(rows.get(ORACLE), HIT_SHARE_OF_ORACLE), "%"),
              _target("TTFT p99 <= round-robin's", row.ttft_p99, rr and rr.ttft_p99, "ms", False)]
    if peer is not None and plan.kind != EXTERNAL:
        other = rows.get(peer)
        checks.append(_target(f"hit >= {peer}'s", row.hit_rate, _hit(other), "pts"))
        checks.append(_target(f"TTFT p99 <= {peer}'s", row.ttft_p99, other and other.ttft_p99, "ms", False))
    if skewed:
        checks.append(_target("max/mean requests <= 1.25", row.max_over_mean, MAX_OVER_MEAN_REQUESTS, "x", False))
        checks.append(_target("hit >= round-robin + 25 pts", row.hit_rate,
                              _hit(rr, points=SKEWED_HIT_POINTS_OVER_BASELINE), "pts"))
        checks.append(_target("E2E p99 <= 1.05 x round-robin's", row.e2e_p99,
                              rr and rr.e2e_p99 and SKEWED_E2E_P99_OVER_BASELINE * rr.e2e_p99, "ms", False))
    if plan.precise:
        checks.append(_target(f"hit >= {PRECISE_SHARE_OF_PRESSURE_ORACLE:.0%} of pressure oracle", row.hit_rate,
                              _hit(rows.get(PRESSURE_ORACLE), PRECISE_SHARE_OF_PRESSURE_ORACLE), "%"))
        checks.append(_target(f"hit >= approximate + {PRECISE_POINTS_OVER_APPROXIMATE * 100:.0f} pts", row.hit_rate,
                              _hit(rows.get("cache-aware"), points=PRECISE_POINTS_OVER_APPROXIMATE), "pts"))
    if plan.gateways > 1:  # single-gateway kvgate rows are named after their policy (and mode)
        single = rows.get(f"{plan.policy} precise" if plan.precise else plan.policy or "")
        checks.append(_target(f"hit >= 1 gateway - {GATEWAY_SCALE_OUT_LOSS * 100:.0f} pts", row.hit_rate,
                              _hit(single, points=-GATEWAY_SCALE_OUT_LOSS), "pts"))
    return checks


# Figures that vary from run to run: a row of repeated runs reports their median and range.
_VARYING = ("hit_rate", "hit_share_of_oracle", "missed_first_turns", "missed_later_turns", "ttft_p50", "ttft_p99",
            "e2e_p50", "e2e_p99", "requests_per_second", "output_tokens_per_second", "max_over_mean")


def combine_runs(runs: Sequence[RowSummary]) -> RowSummary:
    """One row from its repeated runs: each varying figure's median and range, counts summed over the runs."""
    if len(runs) == 1:
        return runs[0]
    found = {name: spread([getattr(run, name) for run in runs]) for name in _VARYING}
    per_replica = [sum(counts) for counts in zip(*(run.replica_requests for run in runs), strict=True)]
    decisions: Counter[str] = Counter()
    for run in runs:
        decisions.update(run.decisions)
    return dataclasses.replace(
        runs[0], **{name: None if value is None else value[0] for name, value in found.items()},
        ranges={name: value[1:] for name, value in found.items() if value is not None},
        requests=sum(r.requests for r in runs), errors=sum(r.errors for r in runs), replica_requests=per_replica,
        replica_shares=_shares(per_replica), preemptions=sum(r.preemptions for r in runs), runs=len(runs),
        decisions=dict(decisions),
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
        routed = plan.kind not in (ORACLE, PRESSURE_ORACLE) and not plan.is_baseline and plan.name != peer
        if routed and summary.failure is None:
            summary.targets = _check_row(plan, summary, by_name, baseline, scenario.skewed, peer)
    return summaries


@dataclass(slots=True)
class ScenarioReport:
    """One load's table, what it sent and the replicas it ran on, and the plots drawn for it (paths relative)."""

    name: str
    description: str
    rows: list[RowSummary]
    plots: dict[str, str]
    sizing: str = ""  # the fleet's and the oracle's caches and seats, in words (simulated replicas only)


@dataclass(slots=True)
class BenchReport:
    """Everything the report files say."""

    command: str
    date: str
    machine: dict[str, Any]
    fleet: dict[str, Any]
    oracle: dict[str, Any]  # the oracle's sizing on real engines; per scenario on simulated replicas
    scenarios: list[ScenarioReport]
    title: str = "Routing benchmark"
    section: str = "routing"  # its section in the docs file

    @property
    def all_targets_met(self) -> bool:
        """Whether every checked row met every target and no row failed to run."""
        rows = [row for scenario in self.scenarios for row in scenario.rows]
        return all(row.failure is None and all(check.passed for check in row.targets) for row in rows)


def _code_line(code: dict[str, Any] | None) -> str:
    """The Markdown line naming the code a report's rows ran (none for a report that does not say)."""
    return f"Code: {describe_code(code)}.  \n" if code else ""


def machine_info() -> dict[str, Any]:
    """The CPUs, OS, Python and load average the benchmark ran on, and the code it ran."""
    return {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_1m": round(os.getloadavg()[0], 2), "code": code_version()}


def _cell(row: RowSummary, figure: str, scale: float, digits: int, unit: str = "") -> str:
    """A figure of a row, with its range over repeated runs."""
    value, low_high = getattr(row, figure), row.ranges.get(figure)
    if value is None:
        return "-"
    shown = f"{value * scale:.{digits}f}{unit}"
    return shown if low_high is None else f"{shown} ({low_high[0] * scale:.{digits}f}-{low_high[1] * scale:.{digits}f})"


_HEADER = ("row", "hit rate", "% of oracle", "missed: first / later turns", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms",
           "E2E p99 ms", "req/s", "out tok/s", "requests", "errors", "max/mean req", "replica shares", "kvgate decisions",
           "targets")


# The figures right-aligned; names, shares, decisions and targets read left to right.
_RIGHT = [False] + [True] * (_HEADER.index("replica shares") - 1)


def _cells(row: RowSummary) -> list[str]:
    if row.failure is not None:
        return [row.name, f"did not run: {row.failure}", *[""] * (len(_HEADER) - 2)]
    targets = [f"{'PASS' if check.passed else 'FAIL'} {check.name} ({check.detail})" for check in row.targets]
    missed = "-" if row.missed_first_turns is None else \
        f"{_cell(row, 'missed_first_turns', 100, 1, '%')} / {_cell(row, 'missed_later_turns', 100, 1, '%')}"
    return [
        row.name, _cell(row, "hit_rate", 100, 1, "%"), _cell(row, "hit_share_of_oracle", 100, 1, "%"), missed,
        *(_cell(row, name, 1000, 0) for name in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")),
        _cell(row, "requests_per_second", 1, 1), _cell(row, "output_tokens_per_second", 1, 0),
        str(row.requests), str(row.errors), _cell(row, "max_over_mean", 1, 2),
        " / ".join(f"{share * 100:.0f}%" for share in row.replica_shares) or "-",
        "<br>".join(f"{reason} {count}" for reason, count in sorted(row.decisions.items()) if count) or "-",
        "<br>".join(targets) or "-",
    ]  # fmt: skip


def _tables(report: BenchReport, with_plots: bool) -> str:
    parts = []
    for scenario in report.scenarios:
        parts.append(f"### {scenario.name}\n\n{scenario.description}{scenario.sizing}\n\n")
        parts.append("\n".join(table(_HEADER, map(_cells, scenario.rows), _RIGHT)) + "\n")
        if with_plots:
            parts.append("\n" + "\n".join(f"![{title}]({path})" for title, path in scenario.plots.items()) + "\n")
        parts.append("\n")
    return "".join(parts)


def _setup(report: BenchReport) -> str:
    fleet, oracle, machine = report.fleet, report.oracle, report.machine
    if "engine" in fleet:
        kind = (f"real engines ({fleet['engine']}), each {fleet['num_gpu_blocks']} KV blocks of {fleet['block_size']} "
                f"tokens, max_num_seqs {fleet['max_num_seqs']}; the workload's text tokenizes at "
                f"{fleet['chars_per_token']} characters per token. Oracle: one engine with {oracle['num_gpu_blocks']} "
                f"blocks and max_num_seqs {oracle['max_num_seqs']}")
    else:
        kind = f"simulated vLLM replicas, speed {fleet['speed']}, sized per scenario (below). Oracle: one replica"
    return (
        f"Command: `{report.command}`  \n"
        f"Machine: {machine['nproc']} CPUs, {machine['platform']}, Python {machine['python']}; {report.date}; "
        f"1-minute load average at the end: {machine['loadavg_1m']}.  \n"
        f"{_code_line(machine.get('code'))}"
        f"Fleet: {fleet['replicas']} {kind} that never evicts, traffic sent to it directly: the hit-rate ceiling. "
        f"Each fleet replica's KV cache holds {fleet['cache_fraction'] * 100:.0f}% of the distinct prefixes in play "
        "(every tenant's system prompt and every open conversation).  \n"
        "Hit rate: prefix-cache hit tokens / queried tokens from the replicas' own counters. Missed: the prompt "
        "tokens conversations' first turns (a tenant's system prompt, where none holds it) and their later turns "
        "(history moved or evicted) did not find cached, each as a share of all prompt tokens, from every answer's "
        "`usage.prompt_tokens_details.cached_tokens` (the replicas run with `--enable-prompt-tokens-details`). Every "
        "row replays "
        "the same requests; replica caches and counters are reset between rows. With several runs per row a "
        "figure is the median, its range in brackets.\n\n"
    )


def render_markdown(report: BenchReport) -> str:
    """report.md: setup, then a table (and plots) per scenario."""
    verdict = "all targets met" if report.all_targets_met else "some targets missed"
    return f"# kvgate {report.title.lower()}\n\n{_setup(report)}Result: {verdict}.\n\n{_tables(report, True)}"


def update_docs(path: Path, report: BenchReport) -> None:
    """Replace the report's section of a docs file: setup and tables, no plots (append it when absent)."""
    write_docs_section(path, report.section, f"## {report.title}\n\n{_setup(report)}{_tables(report, False)}")
