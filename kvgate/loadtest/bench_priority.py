"""Priority classes under overload: interactive latency and batch throughput with and without admission control.

Run: python -m kvgate.loadtest.bench_priority [--quick] [--docs docs/benchmarks.md] [--rows a,b,c,d,e]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import orjson

from kvgate.loadtest.bench.processes import ProcessError
from kvgate.loadtest.priority.bench import Plan, run_benchmark
from kvgate.loadtest.priority.report import render_markdown, write_docs_section
from kvgate.loadtest.priority.rows import ROWS
from kvgate.loadtest.run_meta import RunMeta
from kvgate.simulator import SimOptions

# Small enough for a 2-core machine: tens of requests per second, so the Python load generator keeps its schedule.
SIM = SimOptions(max_num_seqs=32, decode_step_seconds=0.05, default_max_tokens=32, speed=1.0)
FULL = Plan(replicas=3, sim=SIM, max_tokens=32, prompt_words=48, capacity_s=8,
            unloaded_s=30, overload_s=60, rows=("a", "b", "c", "d", "e", "f"))
QUICK = dataclasses.replace(FULL, capacity_s=3, unloaded_s=8, overload_s=10, lead_in_s=1,
                            rows=("a", "b", "c"))


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m kvgate.loadtest.bench_priority", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, rows a-c only")
    parser.add_argument("--rows", help=f"comma-separated rows to run, of {','.join(ROWS)}")
    parser.add_argument("--duration", type=float, help="seconds of each overload run")
    parser.add_argument("--unloaded-duration", type=float, help="seconds of the unloaded run")
    parser.add_argument("--capacity-duration", type=float, help="seconds the capacity probe measures")
    parser.add_argument("--replicas", type=int, help="simulated replicas")
    parser.add_argument("--seed", type=int, help="seed of the Poisson schedules")
    parser.add_argument("--docs", type=Path, help="markdown file whose priority section to replace")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--log-dir", type=Path, help="keep the child processes' logs here")
    return parser


def plan_from_args(ns: argparse.Namespace) -> Plan:
    """The preset the flags pick, with the flags' overrides."""
    plan = QUICK if ns.quick else FULL
    overrides = {"rows": tuple(ns.rows.split(",")) if ns.rows else None, "overload_s": ns.duration,
                 "unloaded_s": ns.unloaded_duration, "capacity_s": ns.capacity_duration, "replicas": ns.replicas,
                 "seed": ns.seed}
    plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    unknown = [key for key in plan.rows if key not in ROWS]
    if unknown:
        raise SystemExit(f"bench_priority: unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    return plan


def _shown_args(args: Sequence[str]) -> list[str]:
    """The flags that shape the results (not where outputs go)."""
    shown: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--docs", "--json", "--log-dir"):
            skip = True
        elif not arg.startswith(("--docs=", "--json=", "--log-dir=")):
            shown.append(arg)
    return shown


async def _main(plan: Plan, log_dir: Path | None) -> dict:
    if log_dir is not None:
        return await run_benchmark(plan, log_dir, print)
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-priority-") as tmp:
        return await run_benchmark(plan, Path(tmp), print)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the markdown report, and write it where the flags say."""
    args = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    plan = plan_from_args(ns)
    run = RunMeta()
    try:
        report = asyncio.run(_main(plan, ns.log_dir))
    except ProcessError as exc:
        print(f"bench_priority: {exc}", file=sys.stderr)
        return 1
    report["meta"] = run.finish(command=shlex.join(["python", "-m", "kvgate.loadtest.bench_priority", *_shown_args(args)]))
    markdown = render_markdown(report)
    print(markdown)
    if ns.json:
        ns.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if ns.docs:
        write_docs_section(ns.docs, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
