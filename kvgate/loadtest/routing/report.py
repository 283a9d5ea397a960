"""The benchmark report: report.json, report.md with one table per scenario, and the docs section."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.loadtest.kit.report import markers, write_docs_section
from kvgate.loadtest.routing.summary import RowSummary, TargetCheck

DOCS_START, DOCS_END = markers("routing")


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


def machine_info() -> dict[str, Any]:
    """The CPUs, OS, Python and load average the benchmark ran on."""
    return {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def _cell(row: RowSummary, figure: str, scale: float, digits: int, unit: str = "") -> str:
    """A figure of a row, with its range over repeated runs."""
    value = getattr(row, figure)
    if value is None:
        return "-"
    low_high = row.ranges.get(figure)
    shown = f"{value * scale:.{digits}f}{unit}"
    return shown if low_high is None else f"{shown} ({low_high[0] * scale:.{digits}f}-{low_high[1] * scale:.{digits}f})"


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
    cells = [
        row.name, _cell(row, "hit_rate", 100, 1, "%"), _cell(row, "hit_share_of_oracle", 100, 1, "%"),
        *(_cell(row, name, 1000, 0) for name in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")),
        _cell(row, "requests_per_second", 1, 1), _cell(row, "output_tokens_per_second", 1, 0),
        str(row.requests), str(row.errors), _cell(row, "max_over_mean", 1, 2), shares,
        _decisions_cell(row.decisions), _targets_cell(row.targets),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |\n"


def _tables(report: BenchReport, with_plots: bool) -> str:
    parts = []
    for scenario in report.scenarios:
        parts.append(f"### {scenario.name}\n\n{scenario.description}{scenario.sizing}\n\n{_HEADER}")
        parts.append("".join(_table_row(row) for row in scenario.rows))
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
        f"Fleet: {fleet['replicas']} {kind} that never evicts, traffic sent to it directly: the hit-rate ceiling. "
        f"Each fleet replica's KV cache holds {fleet['cache_fraction'] * 100:.0f}% of the distinct prefixes in play "
        "(every tenant's system prompt and every open conversation).  \n"
        "Hit rate: prefix-cache hit tokens / queried tokens from the replicas' own counters. Every row replays "
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
