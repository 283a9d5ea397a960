"""`python -m kvgate.loadtest.bench` (and `kvgate bench`): the routing benchmark's command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate.loadtest.bench.plots import plot_replica_load, plot_ttft_cdf
from kvgate.loadtest.bench.processes import ProcessError
from kvgate.loadtest.bench.report import BenchReport, ScenarioReport, machine_info, update_docs, utc_now, write_report
from kvgate.loadtest.bench.results import ScenarioRun
from kvgate.loadtest.bench.runner import BenchSettings, run_bench
from kvgate.loadtest.bench.summary import summarise_scenario
from kvgate.loadtest.bench.vllm_fleet import BLOCK_SIZE, engine_sizing
from kvgate.loadtest.bench.workload import DEFAULT_WORKLOAD, QUICK_WORKLOAD, SKEWS, WorkloadSpec
from kvgate.loadtest.vllm_engine import VLLM_PYTHON_ENV, vllm_python
from kvgate.simulator import SimOptions

DEFAULT_POLICIES = ("cache-aware", "prefix-hash", "least-load")
_WORKLOAD_HELP = {
    "tenants": "tenants, each with its own shared system prompt",
    "system_prompt_chars": "characters of each tenant's system prompt",
    "conversations": "conversations per row",
    "turns": "streamed turns per conversation",
    "user_chars": "mean characters of a user message",
    "max_tokens": "max_tokens of every request",
    "concurrency": "conversations in flight at once",
    "duration": "time cap per row in seconds",
    "zipf_s": "Zipf exponent of tenant popularity under --skew zipf",
    "seed": "seed of the generated texts and tenant draws",
    "model": "model name sent in requests and served by the simulator",
}


def _external(value: str) -> tuple[str, str]:
    name, sep, template = value.partition("=")
    if not sep or not name.strip() or not template.strip():
        raise argparse.ArgumentTypeError("expected NAME=COMMAND TEMPLATE")
    return name.strip(), template.strip()


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's flags to `parser`."""
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the report and plots")
    parser.add_argument("--quick", action="store_true", help="a tiny workload that runs in seconds (for tests)")
    parser.add_argument("--skew", choices=(*SKEWS, "both"), default="both", help="tenant popularity scenarios")
    parser.add_argument("--replicas", type=int, default=3, help="simulated vLLM replicas behind the routers")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="kvgate policies to measure besides the round-robin baseline (comma-separated)")
    parser.add_argument("--gateways", type=int, default=3,
                        help="kvgate processes in the multi-gateway cache-aware row (below 2: no such row)")
    parser.add_argument("--external", type=_external, action="append", default=[], metavar="NAME=TEMPLATE",
                        help="another router's command line; {workers} becomes the replica URLs separated by "
                             "spaces, {port} its listen port (repeatable)")
    parser.add_argument("--cache-fraction", type=float, default=0.5,
                        help="share of the distinct prefixes in play (every tenant's system prompt and every open "
                             "conversation) one replica's KV cache holds")
    parser.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    parser.add_argument("--vllm", action="store_true",
                        help=f"real vLLM engines (the CPU build, one per core) instead of simulated replicas; the "
                             f"interpreter with vLLM comes from {VLLM_PYTHON_ENV} (./dev real creates .venv-vllm)")
    parser.add_argument("--precise", action="store_true",
                        help="simulated replicas tokenize with a tiny local model and publish KV events: adds a "
                             "pressure oracle and cache-aware rows routed on the events")
    parser.add_argument("--docs", type=Path, help="also write the tables into this Markdown file's routing section")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    workload = parser.add_argument_group("workload (defaults: a ~5 minute run; --quick: seconds)")
    for knob in dataclasses.fields(WorkloadSpec):
        if knob.name in _WORKLOAD_HELP:
            kind = type(knob.default)
            workload.add_argument("--" + knob.name.replace("_", "-"), type=kind, default=None,
                                  help=f"{_WORKLOAD_HELP[knob.name]} (default {knob.default})")


def settings_from_args(ns: argparse.Namespace) -> BenchSettings:
    """BenchSettings from parsed flags; ValueError for values that make no sense."""
    preset = QUICK_WORKLOAD if ns.quick else DEFAULT_WORKLOAD
    overrides = {name: getattr(ns, name) for name in _WORKLOAD_HELP if getattr(ns, name) is not None}
    workload = dataclasses.replace(preset, **overrides)
    if ns.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {ns.replicas}")
    if ns.cache_fraction <= 0:
        raise ValueError(f"--cache-fraction must be > 0, got {ns.cache_fraction}")
    if ns.vllm and vllm_python() is None:
        raise ValueError(f"--vllm needs {VLLM_PYTHON_ENV}: an interpreter with vLLM installed (./dev real makes one)")
    if ns.vllm and ns.precise:
        raise ValueError("--precise runs on simulated replicas; real engines publishing KV events are not wired in yet")
    return BenchSettings(
        workload=workload,
        skews=SKEWS if ns.skew == "both" else (ns.skew,),
        replicas=ns.replicas,
        policies=tuple(name.strip() for name in ns.policies.split(",") if name.strip()),
        gateways=ns.gateways,
        externals=tuple(ns.external),
        cache_fraction=ns.cache_fraction,
        sim=SimOptions(speed=ns.speed),
        out_dir=ns.out,
        vllm_python=vllm_python() if ns.vllm else None,
        tokenizer_dir=ns.out / "tiny-model" if ns.precise else None,
    )


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_report(settings: BenchSettings, scenarios: Sequence[ScenarioRun], command: str) -> BenchReport:
    """Summarise every scenario and draw its plots into the output directory."""
    reports = []
    for scenario in scenarios:
        plots = {
            "TTFT CDF": plot_ttft_cdf(scenario, settings.out_dir / f"ttft_cdf_{scenario.name}.png"),
            "per-replica load": plot_replica_load(scenario, settings.out_dir / f"replica_load_{scenario.name}.png"),
        }
        reports.append(ScenarioReport(
            name=scenario.name,
            workload=dataclasses.asdict(scenario.workload),
            rows=summarise_scenario(scenario),
            plots={title: path.name for title, path in plots.items()},
        ))
    base = {"command": command, "date": utc_now(), "machine": machine_info(), "scenarios": reports}
    if settings.vllm_python is not None:
        sizing = engine_sizing(settings.workload, settings.cache_fraction, settings.out_dir / "vllm")
        return BenchReport(**base, title="Routing benchmark on real vLLM engines", section="routing-real-engines",
                           fleet={"replicas": settings.replicas, "engine": "vLLM 0.32.0 CPU build, tiny random-weight "
                                  "Llama, one core each", "cache_fraction": settings.cache_fraction,
                                  "num_gpu_blocks": sizing.fleet_blocks, "block_size": BLOCK_SIZE,
                                  "max_num_seqs": sizing.fleet_seats, "chars_per_token": round(sizing.chars_per_token, 2)},
                           oracle={"num_gpu_blocks": sizing.oracle_blocks, "max_num_seqs": sizing.oracle_seats})
    fleet, oracle = settings.fleet_options(), settings.oracle_options()
    return BenchReport(
        **base,
        fleet={"replicas": settings.replicas, "cache_fraction": settings.cache_fraction,
               **{key: getattr(fleet, key) for key in ("num_gpu_blocks", "block_size", "max_num_seqs", "speed")}},
        oracle={key: getattr(oracle, key) for key in ("num_gpu_blocks", "max_num_seqs")},
    )


def run_from_args(ns: argparse.Namespace, command: str) -> int:
    """Run the benchmark a parsed command line asks for; `command` is recorded in the report."""
    try:
        settings = settings_from_args(ns)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    if settings.tokenizer_dir is not None:
        from kvgate.loadtest.tiny_model import write_tiny_model

        write_tiny_model(settings.tokenizer_dir)
    try:
        scenarios = asyncio.run(run_bench(settings, _progress))
    except ProcessError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    report = build_report(settings, scenarios, command)
    markdown, _ = write_report(report, settings.out_dir)
    if ns.docs is not None:
        update_docs(ns.docs, report)
    print(markdown.read_text(encoding="utf-8"))
    _progress(f"report written to {markdown} and {settings.out_dir / 'report.json'}")
    failed_rows = any(row.failure for scenario in report.scenarios for row in scenario.rows)
    return 1 if failed_rows or (ns.strict and not report.all_targets_met) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m kvgate.loadtest.bench`."""
    parser = argparse.ArgumentParser(prog="python -m kvgate.loadtest.bench", description=__doc__)
    add_bench_arguments(parser)
    args = list(sys.argv[1:] if argv is None else argv)
    return run_from_args(parser.parse_args(args), " ".join([parser.prog, shlex.join(args)]).strip())
