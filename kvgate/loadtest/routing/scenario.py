"""`kvgate bench routing`: kvgate's policies (and --external routers) on a simulated fleet, closed-loop chats; also
the routing family's shared command line and report (`chats`, `real-engines`, `inference-perf`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate.loadtest.cli import add_external_argument, add_knobs, with_knobs
from kvgate.loadtest.kit.report import BadOption, publish, utc_now
from kvgate.loadtest.kit.tiny_model import write_tiny_model
from kvgate.loadtest.routing.client import ChatLoad, Load
from kvgate.loadtest.routing.plots import plot_replica_load, plot_ttft_cdf
from kvgate.loadtest.routing.report import (
    BenchReport,
    ScenarioReport,
    ScenarioRun,
    machine_info,
    render_markdown,
    summarise_scenario,
    update_docs,
)
from kvgate.loadtest.routing.runner import BenchSettings, run_bench
from kvgate.loadtest.routing.workload import DEFAULT_WORKLOAD, QUICK_WORKLOAD, SKEWS, WorkloadSpec
from kvgate.simulator import SimOptions

DEFAULT_POLICIES = ("cache-aware", "prefix-hash", "least-load")
_WORKLOAD_HELP = {
    "tenants": "tenants, each with its own shared system prompt",
    "system_prompt_chars": "characters of each tenant's system prompt (0: chats without one)",
    "conversations": "conversations per row",
    "turns": "streamed turns per conversation",
    "user_chars": "mean characters of a user message",
    "max_tokens": "max_tokens of every request",
    "concurrency": "concurrent users (with --rate: conversations open at once)",
    "rate": "Poisson arrivals, requests per second (0: users back to back)",
    "zipf_s": "Zipf exponent of tenant popularity under Zipf skew",
    "model": "model name sent in requests and served by the simulator",
}


def add_router_arguments(parser: argparse.ArgumentParser, policies: Sequence[str] = DEFAULT_POLICIES) -> None:
    """The routers of every routing scenario: fleet size, kvgate policies and gateways, other routers."""
    parser.add_argument("--replicas", type=int, default=3, help="vLLM replicas behind the routers")
    parser.add_argument("--policies", default=",".join(policies),
                        help="kvgate policies to measure besides the round-robin baseline (comma-separated)")
    parser.add_argument("--gateways", type=int, default=3,
                        help="kvgate processes in the multi-gateway cache-aware row (below 2: no such row)")
    add_external_argument(parser)
    parser.add_argument("--peer", help="the --external row kvgate's rows are held to (hit rate, TTFT p99)")
    parser.add_argument("--cache-fraction", type=float, default=0.5,
                        help="share of the distinct prefixes in play (every tenant's system prompt and every open "
                             "conversation) one replica's KV cache holds")
    parser.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")


def add_workload_arguments(parser: argparse.ArgumentParser, preset: WorkloadSpec) -> None:
    """The chat workload's knobs, each overriding the scenario's preset."""
    add_knobs(parser, preset, _WORKLOAD_HELP, "chat workload (--quick: a tiny one)")


def workload(options: argparse.Namespace, preset: WorkloadSpec) -> WorkloadSpec:
    """The preset with the flags' overrides (--seed and --duration included)."""
    return with_knobs(options, preset, [*_WORKLOAD_HELP, "seed", "duration"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The routing scenario's flags."""
    add_router_arguments(parser)
    parser.add_argument("--skew", choices=(*SKEWS, "both"), default="both", help="tenant popularity")
    add_precise_argument(parser)
    add_workload_arguments(parser, DEFAULT_WORKLOAD)


def add_precise_argument(parser: argparse.ArgumentParser) -> None:
    """--precise: rows routed on the replicas' KV events."""
    parser.add_argument("--precise", action="store_true",
                        help="the replicas publish KV events (simulated ones tokenize with a tiny local model): adds a "
                             "pressure oracle and cache-aware rows routed on the events")


def precise_tokenizer(options: argparse.Namespace) -> Path | None:
    """With --precise, the tiny model directory the simulated replicas and kvgate tokenize with (written now)."""
    return write_tiny_model(options.out / "tiny-model") if options.precise else None


def chat_loads(options: argparse.Namespace) -> tuple[ChatLoad, ...]:
    """The closed-loop chats on uniform and/or Zipf-skewed tenants."""
    spec = workload(options, QUICK_WORKLOAD if options.quick else DEFAULT_WORKLOAD)
    return tuple(ChatLoad(skew, spec.with_skew(skew)) for skew in (SKEWS if options.skew == "both" else (options.skew,)))


def run(options: argparse.Namespace) -> int:
    """Measure every row on uniform and/or Zipf-skewed tenants."""
    return run_loads(options, chat_loads(options), "Routing benchmark", "routing",
                     tokenizer_dir=precise_tokenizer(options))


def settings_from(options: argparse.Namespace, loads: Sequence[Load], vllm_python: str | None = None,
                  tokenizer_dir: Path | None = None) -> BenchSettings:
    """BenchSettings from parsed flags; BadOption for values that make no sense."""
    if options.replicas < 1:
        raise BadOption(f"--replicas must be >= 1, got {options.replicas}")
    if options.cache_fraction <= 0:
        raise BadOption(f"--cache-fraction must be > 0, got {options.cache_fraction}")
    externals = tuple(options.external)
    if options.peer is not None and options.peer not in dict(externals):
        raise BadOption(f"--peer {options.peer}: no --external row of that name")
    return BenchSettings(
        loads=tuple(loads), replicas=options.replicas,
        policies=tuple(name.strip() for name in options.policies.split(",") if name.strip()),
        gateways=options.gateways, externals=externals, cache_fraction=options.cache_fraction,
        sim=SimOptions(speed=options.speed, enable_prompt_tokens_details=True), out_dir=options.out, runs=options.runs,
        vllm_python=vllm_python, tokenizer_dir=tokenizer_dir,
    )  # fmt: skip


def _sizing(scenario: ScenarioRun) -> str:
    fleet, oracle = scenario.fleet, scenario.oracle
    if fleet is None or oracle is None:
        return ""
    return (f" Each replica: {fleet.num_gpu_blocks} KV blocks of {fleet.block_size} tokens, max_num_seqs "
            f"{fleet.max_num_seqs}; oracle: {oracle.num_gpu_blocks} blocks, max_num_seqs {oracle.max_num_seqs}.")


def build_report(settings: BenchSettings, scenarios: Sequence[ScenarioRun], options: argparse.Namespace,
                 title: str, section: str, fleet: dict | None = None, oracle: dict | None = None) -> BenchReport:
    """Summarise every scenario and draw its plots into the output folder."""
    reports = []
    for scenario in scenarios:
        plots = {
            "TTFT CDF": plot_ttft_cdf(scenario, settings.out_dir / f"ttft_cdf_{scenario.name}.png"),
            "per-replica load": plot_replica_load(scenario, settings.out_dir / f"replica_load_{scenario.name}.png"),
        }
        reports.append(ScenarioReport(scenario.name, scenario.description, summarise_scenario(scenario, options.peer),
                                      {title: path.name for title, path in plots.items()}, _sizing(scenario)))
    fleet = fleet or {"replicas": settings.replicas, "cache_fraction": settings.cache_fraction,
                      "speed": settings.sim.speed}
    return BenchReport(command=options.command, date=utc_now(), machine=machine_info(), fleet=fleet,
                       oracle=oracle or {}, scenarios=reports, title=title, section=section)


def run_loads(options: argparse.Namespace, loads: Sequence[Load], title: str, section: str,
              vllm_python: str | None = None, tokenizer_dir: Path | None = None) -> int:
    """Run every load's rows and write the report; 1 if a row failed (or, with --strict, missed a target)."""
    settings = settings_from(options, loads, vllm_python, tokenizer_dir)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    scenarios = asyncio.run(run_bench(settings, lambda line: print(line, file=sys.stderr, flush=True)))
    report = build_report(settings, scenarios, options, title, section, *_engine_sizing(settings))
    publish(options.out, section, dataclasses.asdict(report) | {"all_targets_met": report.all_targets_met},
            render_markdown(report), None)
    if options.docs is not None:
        update_docs(options.docs, report)
    failed_rows = any(row.failure for scenario in report.scenarios for row in scenario.rows)
    return 1 if failed_rows or (options.strict and not report.all_targets_met) else 0


def _engine_sizing(settings: BenchSettings) -> tuple[dict | None, dict | None]:
    """The real engines' fleet and oracle for the report; (None, None) on simulated replicas."""
    if settings.vllm_python is None:
        return None, None
    from kvgate.loadtest.routing.vllm_fleet import BLOCK_SIZE, engine_sizing

    load = settings.loads[0]
    assert isinstance(load, ChatLoad)
    sizing = engine_sizing(load.spec, settings.cache_fraction, settings.out_dir / "vllm")
    return ({"replicas": settings.replicas, "engine": "vLLM 0.32.0 CPU build, tiny random-weight Llama, one core each",
             "cache_fraction": settings.cache_fraction, "num_gpu_blocks": sizing.fleet_blocks, "block_size": BLOCK_SIZE,
             "max_num_seqs": sizing.fleet_seats, "chars_per_token": round(sizing.chars_per_token, 2)},
            {"num_gpu_blocks": sizing.oracle_blocks, "max_num_seqs": sizing.oracle_seats})
