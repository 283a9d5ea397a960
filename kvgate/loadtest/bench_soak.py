"""Soak: kvgate under minutes of streaming load with faults; is its memory flat and do descriptors come back?

Run: python -m kvgate.loadtest.bench_soak [--minutes M] [--concurrency N] [--quick] [--docs docs/benchmarks.md]
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
from kvgate.loadtest.docs_section import write_docs_section
from kvgate.loadtest.run_meta import RunMeta
from kvgate.simulator import SimOptions
from kvgate.loadtest.soak.load import LoadShape
from kvgate.loadtest.soak.report import SECTION, plot, render_markdown
from kvgate.loadtest.soak.run import SoakPlan, run_soak

_SHAPE = LoadShape(model=SimOptions().models[0], concurrency=240, max_tokens=48, think_s=2.0, fault_interval_s=10.0,
                   aborts_per_round=5, slow_readers_per_round=2, slow_reader_max_tokens=300, slow_read_bytes=512,
                   slow_read_interval_s=0.05, slow_read_max_s=40.0)
FULL = SoakPlan(minutes=10, shape=_SHAPE, replicas=3, sim=SimOptions(max_num_seqs=128, decode_step_seconds=0.03),
                sample_interval_s=5.0, warmup_s=120.0, kill_interval_s=60.0, replica_down_s=5.0, settle_s=75.0)
QUICK = dataclasses.replace(
    FULL, minutes=0.5, sample_interval_s=1.0, warmup_s=10.0, kill_interval_s=10.0, replica_down_s=2.0, settle_s=3.0,
    shape=dataclasses.replace(_SHAPE, concurrency=30, think_s=0.5, fault_interval_s=5.0, aborts_per_round=2,
                              slow_readers_per_round=1, slow_reader_max_tokens=100, slow_read_max_s=15.0))


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m kvgate.loadtest.bench_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 30 s with 30 streams")
    parser.add_argument("--minutes", type=float, help="minutes of load")
    parser.add_argument("--concurrency", type=int, help="steady streaming clients")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for soak.json, .md and .png")
    parser.add_argument("--docs", type=Path, help="Markdown file whose soak section to (re)write")
    parser.add_argument("--log-dir", type=Path, help="keep the child processes' logs here")
    return parser


def plan_from_args(ns: argparse.Namespace) -> SoakPlan:
    """The preset the flags pick, with the flags' overrides."""
    plan = QUICK if ns.quick else FULL
    if ns.minutes is not None:
        if ns.minutes <= 0:
            raise SystemExit("bench_soak: --minutes must be > 0")
        plan = dataclasses.replace(plan, minutes=ns.minutes, warmup_s=min(plan.warmup_s, ns.minutes * 60 / 3))
    if ns.concurrency is not None:
        if ns.concurrency < 1:
            raise SystemExit("bench_soak: --concurrency must be >= 1")
        plan = dataclasses.replace(plan, shape=dataclasses.replace(plan.shape, concurrency=ns.concurrency))
    return plan


def _command(ns: argparse.Namespace) -> str:
    """The command line that repeats this run's settings (not where its outputs went)."""
    words = ["python", "-m", "kvgate.loadtest.bench_soak", *(["--quick"] if ns.quick else [])]
    for flag, value in (("--minutes", ns.minutes), ("--concurrency", ns.concurrency)):
        if value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


async def _run(plan: SoakPlan, log_dir: Path | None) -> dict:
    if log_dir is not None:
        return await run_soak(plan, log_dir)
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as scratch:
        return await run_soak(plan, Path(scratch))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak, write bench-out/soak.{json,md,png} and optionally the docs section; print the Markdown."""
    args = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    plan = plan_from_args(ns)
    run = RunMeta()
    try:
        report = asyncio.run(_run(plan, ns.log_dir))
    except ProcessError as exc:
        print(f"bench_soak: {exc}", file=sys.stderr)
        return 1
    report["meta"] = run.finish(command=_command(ns), plot=str(ns.out / "soak.png"))
    ns.out.mkdir(parents=True, exist_ok=True)
    plot(report, ns.out / "soak.png")
    markdown = render_markdown(report)
    (ns.out / "soak.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (ns.out / "soak.md").write_text(markdown)
    if ns.docs:
        write_docs_section(ns.docs, SECTION, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
