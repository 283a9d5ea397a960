"""`kvgate bench priority`: interactive latency and batch throughput under overload, with and without admission
control; the children's logs go to OUT/logs."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from kvgate.loadtest.kit.report import BadOption, RunMeta, publish
from kvgate.loadtest.priority.bench import Plan, run_benchmark
from kvgate.loadtest.priority.report import render_markdown
from kvgate.loadtest.priority.rows import ROWS
from kvgate.simulator import SimOptions

# Small enough for a 2-core machine: tens of requests per second, so the Python load generator keeps its schedule.
SIM = SimOptions(max_num_seqs=32, decode_step_seconds=0.05, default_max_tokens=32, speed=1.0)
FULL = Plan(replicas=3, sim=SIM, max_tokens=32, prompt_words=48, capacity_s=8,
            unloaded_s=30, overload_s=60, rows=("a", "b", "c", "d", "e", "f", "g", "h"))
# Fleets whose binding limit differs (--fleet): seats; the KV cache (prompts of ~1,500 tokens, 500 blocks of 16
# tokens per replica: about 5 sequences fit in 8 seats); compute (256 seats, each running sequence slows a step).
FLEETS = {
    "seats32": {},
    "kv-bound": {"sim": SimOptions(max_num_seqs=8, num_gpu_blocks=500, max_model_len=4096, decode_step_seconds=0.05,
                                   default_max_tokens=32), "prompt_words": 1000, "rows": ("b", "g", "h")},
    "seats256": {"sim": SimOptions(max_num_seqs=256, num_gpu_blocks=4096, decode_step_seconds=0.02,
                                   decode_seconds_per_seq=0.0004, default_max_tokens=32), "rows": ("b", "g", "h")},
}
QUICK = dataclasses.replace(FULL, capacity_s=3, unloaded_s=8, overload_s=10, lead_in_s=1,
                            rows=("a", "b", "c"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Rows, the other runs' lengths and the fleet (--duration is each overload run's)."""
    parser.add_argument("--rows", help=f"comma-separated rows to run, of {','.join(ROWS)} (--quick: a-c)")
    parser.add_argument("--unloaded-duration", type=float, help="seconds of the unloaded run")
    parser.add_argument("--capacity-duration", type=float, help="seconds the capacity probe measures")
    parser.add_argument("--replicas", type=int, help="simulated replicas")
    parser.add_argument("--fleet", choices=sorted(FLEETS), default="seats32",
                        help="the fleet's binding limit: seats (32 each), the KV cache, or compute (256 seats)")


def plan_from(options: argparse.Namespace) -> Plan:
    """The preset the flags pick, with the flags' overrides; BadOption naming an unknown row."""
    overrides = {"rows": tuple(options.rows.split(",")) if options.rows else None, "overload_s": options.duration,
                 "unloaded_s": options.unloaded_duration, "capacity_s": options.capacity_duration,
                 "replicas": options.replicas, "seed": options.seed}
    preset = dataclasses.replace(QUICK if options.quick else FULL, **FLEETS[options.fleet])
    plan = dataclasses.replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    unknown = [key for key in plan.rows if key not in ROWS]
    if unknown:
        raise BadOption(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    return plan


def run(options: argparse.Namespace) -> int:
    """Run every row, write priority.{json,md} and the docs section, print the Markdown."""
    plan = plan_from(options)
    meta = RunMeta()
    report = asyncio.run(run_benchmark(plan, options.out / "logs", print))
    report["meta"] = meta.finish(command=options.command)
    section = "priority" if options.fleet == "seats32" else f"priority-{options.fleet}"
    publish(options.out, section, report, render_markdown(report), options.docs)
    return 0
