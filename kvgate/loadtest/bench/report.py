"""The benchmark report: report.json, report.md with one table per scenario, and the docs section."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from kvgate.loadtest import docs_section
from kvgate.loadtest.bench.summary import RowSummary, TargetCheck

DOCS_START, DOCS_END = docs_section.markers("routing")


@dataclass(slots=True)
class ScenarioReport:
    """One scenario's fleet, table and the plots drawn for it (paths relative to the report)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fleet: dict[str, Any]  # each replica's KV blocks, block size, seats
    oracle: dict[str, Any]
    rows: list[RowSummary]
    plots: dict[str, str]


@dataclass(slots=True)
class BenchReport:
    """Everything the report files say."""

    command: str
    date: str
    machine: dict[str, Any]
    fleet: dict[str, Any]  # replicas, cache fraction, speed
    scenarios: list[ScenarioReport]
    load_average: str = ""  # the machine's 1-minute load average before / after the run

    @property
    def all_targets_met(self) -> bool:
        """Whether every checked row met every target and no row failed to run."""
        rows = [row for scenario in self.scenarios for row in scenario.rows]
        return all(row.failure is None and all(check.passed for check in row.targets) for row in rows)


def load_average() -> str:
    """The machine's 1-minute load average now."""
    return f"{os.getloadavg()[0]:.2f}"


def machine_info() -> dict[str, Any]:
    """The CPUs, OS and Python the benchmark ran on."""
    return {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def utc_now() -> str:
    """The current UTC time to the minute."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def _targets_cell(checks: Sequence[TargetCheck]) -> str:
    if not checks:
        return "-"
    return "<br>".join(f"{'PASS' if check.passed else 'FAIL'} {check.name} ({check.detail})" for check in checks)


_HEADER = (
    "| row | hit rate | % of oracle | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms | req/s | out tok/s "
    "| requests | errors | max/mean req | replica shares | kvgate decisions | targets |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|\n"
)


def _decisions_cell(decisions: dict[str, int]) -> str:
    """How a kvgate row routed, by reason: prefix hit, cold placement, overflow past a replica at its load cap, ..."""
    return "<br>".join(f"{reason} {count}" for reason, count in sorted(decisions.items()) if count) or "-"


def _table_row(row: RowSummary) -> str:
    if row.failure is not None:
        return f"| {row.name} | did not run: {row.failure} |" + " |" * 13 + "\n"
    shares = " / ".join(f"{share * 100:.0f}%" for share in row.replica_shares) or "-"
    balance = "-" if row.max_over_mean is None else f"{row.max_over_mean:.2f}"
    cells = [
        row.name, _pct(row.hit_rate), _pct(row.hit_share_of_oracle), _ms(row.ttft_p50), _ms(row.ttft_p99),
        _ms(row.e2e_p50), _ms(row.e2e_p99), f"{row.requests_per_second:.1f}", f"{row.output_tokens_per_second:.0f}",
        str(row.requests), str(row.errors), balance, shares, _decisions_cell(row.decisions), _targets_cell(row.targets),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |\n"


def _tables(report: BenchReport, with_plots: bool) -> str:
    parts = []
    for scenario in report.scenarios:
        fleet, oracle = scenario.fleet, scenario.oracle
        parts.append(
            f"### {scenario.name}\n\n{scenario.description} Each replica: {fleet['num_gpu_blocks']} KV blocks of "
            f"{fleet['block_size']} tokens, max_num_seqs {fleet['max_num_seqs']}; oracle: {oracle['num_gpu_blocks']} "
            f"blocks, max_num_seqs {oracle['max_num_seqs']}.\n\n{_HEADER}"
        )
        parts.append("".join(_table_row(row) for row in scenario.rows))
        if with_plots:
            parts.append("\n" + "\n".join(f"![{title}]({path})" for title, path in scenario.plots.items()) + "\n")
        parts.append("\n")
    return "".join(parts)


def _setup(report: BenchReport) -> str:
    fleet, machine = report.fleet, report.machine
    return (
        f"Command: `{report.command}`  \n"
        f"Machine: {machine['nproc']} CPUs, {machine['platform']}, Python {machine['python']}; {report.date}; "
        f"1-minute load average before / after: {report.load_average}.  \n"
        f"Fleet: {fleet['replicas']} simulated vLLM replicas per scenario, each KV cache sized to hold "
        f"{fleet['cache_fraction'] * 100:.0f}% of the distinct prefixes in play (every tenant's or group's system "
        f"prompt and every open conversation), speed {fleet['speed']}. Oracle: one replica that never evicts, "
        f"traffic sent to it directly: the hit-rate ceiling.  \n"
        "Hit rate: prefix-cache hit tokens / queried tokens from the replicas' own counters. Every row replays "
        "the same requests; replica caches and counters are reset between rows.\n\n"
    )


def render_markdown(report: BenchReport) -> str:
    """report.md: setup, then a table (and plots) per scenario."""
    verdict = "all targets met" if report.all_targets_met else "some targets missed"
    return f"# kvgate routing benchmark\n\n{_setup(report)}Result: {verdict}.\n\n{_tables(report, True)}"


def update_docs(path: Path, report: BenchReport) -> None:
    """Replace the routing section of a docs file: setup and tables, no plots (append it when absent)."""
    docs_section.write_docs_section(path, "routing", f"## Routing benchmark\n\n{_setup(report)}{_tables(report, False)}")


def write_report(report: BenchReport, out_dir: Path) -> tuple[Path, Path]:
    """Write report.md and report.json into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = out_dir / "report.md"
    markdown.write_text(render_markdown(report), encoding="utf-8")
    data = dataclasses.asdict(report) | {"all_targets_met": report.all_targets_met}
    json_path = out_dir / "report.json"
    json_path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return markdown, json_path
