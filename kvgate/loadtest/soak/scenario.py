"""`kvgate bench soak`: kvgate under minutes of streaming load with faults; is its memory flat and do descriptors
come back? The children's logs go to OUT/logs, the plot to OUT/soak.png."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from kvgate.loadtest.kit.report import BadOption, RunMeta, publish
from kvgate.loadtest.soak.load import LoadShape
from kvgate.loadtest.soak.report import plot, render_markdown
from kvgate.loadtest.soak.run import SoakPlan, run_soak
from kvgate.simulator import SimOptions

_SHAPE = LoadShape(model=SimOptions().models[0], concurrency=240, max_tokens=48, think_s=2.0, fault_interval_s=10.0,
                   aborts_per_round=5, slow_readers_per_round=2, slow_reader_max_tokens=300, slow_read_bytes=512,
                   slow_read_interval_s=0.05, slow_read_max_s=40.0)
FULL = SoakPlan(minutes=10, shape=_SHAPE, replicas=3, sim=SimOptions(max_num_seqs=128, decode_step_seconds=0.03),
                sample_interval_s=5.0, warmup_s=120.0, kill_interval_s=60.0, replica_down_s=5.0, settle_s=75.0)
QUICK = dataclasses.replace(
    FULL, minutes=0.5, sample_interval_s=1.0, warmup_s=10.0, kill_interval_s=10.0, replica_down_s=2.0, settle_s=3.0,
    shape=dataclasses.replace(_SHAPE, concurrency=30, think_s=0.5, fault_interval_s=5.0, aborts_per_round=2,
                              slow_readers_per_round=1, slow_reader_max_tokens=100, slow_read_max_s=15.0))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The number of steady clients (--duration is the load's length in seconds)."""
    parser.add_argument("--concurrency", type=int, help="steady streaming clients")


def plan_from(options: argparse.Namespace) -> SoakPlan:
    """The preset the flags pick, with the flags' overrides; BadOption for a value that makes no sense."""
    plan = QUICK if options.quick else FULL
    if options.duration is not None:
        if options.duration <= 0:
            raise BadOption("--duration must be > 0")
        plan = dataclasses.replace(plan, minutes=options.duration / 60, warmup_s=min(plan.warmup_s, options.duration / 3))
    shape = plan.shape
    if options.concurrency is not None:
        if options.concurrency < 1:
            raise BadOption("--concurrency must be >= 1")
        shape = dataclasses.replace(shape, concurrency=options.concurrency)
    if options.seed is not None:
        shape = dataclasses.replace(shape, seed=options.seed)
    return dataclasses.replace(plan, shape=shape)


def run(options: argparse.Namespace) -> int:
    """Run the soak, write soak.{json,md,png} and the docs section, print the Markdown."""
    plan = plan_from(options)
    logging.getLogger("kvgate.loadtest").setLevel(logging.INFO)
    meta = RunMeta()
    report = asyncio.run(run_soak(plan, options.out / "logs"))
    report["meta"] = meta.finish(command=options.command, plot=str(options.out / "soak.png"))
    options.out.mkdir(parents=True, exist_ok=True)
    plot(report, options.out / "soak.png")
    publish(options.out, "soak", report, render_markdown(report), options.docs)
    return 0
