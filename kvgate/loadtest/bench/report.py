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
    """One scenario's table and the plots drawn for it (paths relative to the report)."""

    name: str
    workload: dict[str, Any]
    rows: list[RowSummary]
    plots: dict[str, str]


@dataclass(slots=True)
class BenchReport:
    """Everything the report files say."""

    command: str
    date: str
    machine: dict[str, Any]
    fleet: dict[str, Any]
    oracle: dict[str, Any]
    scenarios: list[ScenarioReport]
    title: str = "Routing benchmark"
    section: str = "routing"  # its section in the docs file

    @property
    def all_targets_met(self) -> bool:
        """Whether every checked row met every target and no row failed to run."""
        rows = [row for scenario in self.scenarios for row in scenario.rows]
        return all(row.failure is None and all(check.passed for check in row.targets) for row in rows)


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


def _describe_workload(workload: dict[str, Any]) -> str:
    skew = "Zipf-skewed" if workload["skew"] == "zipf" else "uniform"
    zipf = f" (s={workload['zipf_s']})" if workload["skew"] == "zipf" else ""
    return (
        f"{workload['tenants']} tenants, {skew} popularity{zipf}, each with a "
        f"{workload['system_prompt_chars']}-character system prompt; {workload['conversations']} conversations of "
        f"{workload['turns']} streamed turns (~{workload['user_chars']} characters each, max_tokens "
        f"{workload['max_tokens']}), {workload['concurrency']} concurrent users, capped at {workload['duration']:.0f} s"
        " per row."
    )


def _tables(report: BenchReport, with_plots: bool) -> str:
    parts = []
    for scenario in report.scenarios:
        parts.append(f"### {scenario.name} tenants\n\n{_describe_workload(scenario.workload)}\n\n{_HEADER}")
        parts.append("".join(_table_row(row) for row in scenario.rows))
        if with_plots:
            parts.append("\n" + "\n".join(f"![{title}]({path})" for title, path in scenario.plots.items()) + "\n")
        parts.append("\n")
    return "".join(parts)


def _replica_kind(fleet: dict[str, Any]) -> str:
    return f"real engines ({fleet['engine']})" if "engine" in fleet else "simulated vLLM replicas"


def _replica_detail(fleet: dict[str, Any]) -> str:
    if "engine" in fleet:
        return f"; the workload's text tokenizes at {fleet['chars_per_token']} characters per token"
    return f", speed {fleet['speed']}"


def _setup(report: BenchReport) -> str:
    fleet, oracle, machine = report.fleet, report.oracle, report.machine
    return (
        f"Command: `{report.command}`  \n"
        f"Machine: {machine['nproc']} CPUs, {machine['platform']}, Python {machine['python']}; {report.date}.  \n"
        f"Fleet: {fleet['replicas']} {_replica_kind(fleet)}, each {fleet['num_gpu_blocks']} KV blocks of "
        f"{fleet['block_size']} tokens (room for {fleet['cache_fraction'] * 100:.0f}% of the distinct prefixes in "
        f"play: every tenant's system prompt and every open conversation), "
        f"max_num_seqs {fleet['max_num_seqs']}{_replica_detail(fleet)}.  \n"
        f"Oracle: one replica with {oracle['num_gpu_blocks']} blocks (never evicts) and max_num_seqs "
        f"{oracle['max_num_seqs']}, traffic sent to it directly: the hit-rate ceiling.  \n"
        "Hit rate: prefix-cache hit tokens / queried tokens from the replicas' own counters. Every row replays "
        "the same conversations; replica caches and counters are reset between rows.\n\n"
    )


def render_markdown(report: BenchReport) -> str:
    """report.md: setup, then a table (and plots) per scenario."""
    verdict = "all targets met" if report.all_targets_met else "some targets missed"
    return f"# kvgate {report.title.lower()}\n\n{_setup(report)}Result: {verdict}.\n\n{_tables(report, True)}"


def update_docs(path: Path, report: BenchReport) -> None:
    """Replace the report's section of a docs file: setup and tables, no plots (append it when absent)."""
    docs_section.write_docs_section(path, report.section, f"## {report.title}\n\n{_setup(report)}{_tables(report, False)}")


def write_report(report: BenchReport, out_dir: Path) -> tuple[Path, Path]:
    """Write report.md and report.json into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = out_dir / "report.md"
    markdown.write_text(render_markdown(report), encoding="utf-8")
    data = dataclasses.asdict(report) | {"all_targets_met": report.all_targets_met}
    json_path = out_dir / "report.json"
    json_path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return markdown, json_path
