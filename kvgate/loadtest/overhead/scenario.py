"""`kvgate bench overhead`: throughput and latency direct to instant stub replicas vs through kvgate, CPU per
streamed chunk, and where kvgate's CPU goes (py-spy)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.loadtest.cli import with_knobs
from kvgate.loadtest.kit.report import RunMeta, publish, table
from kvgate.loadtest.overhead.client import LoadSpec
from kvgate.loadtest.overhead.rig import py_spy_path, running_rig, wrk_available

_COMPARISON = ("load", "generator", "direct req/s", "via kvgate req/s", "ratio", "direct p50 ms", "added p50 ms",
               "direct p99 ms", "added p99 ms", "errors", "kvgate CPU busy", "bound by")


def _comparison_row(row: dict[str, Any]) -> tuple[object, ...]:
    direct, kvgate = row["direct"], row["kvgate"]
    return (row["name"], kvgate["generator"], f"{direct['rps']:.0f}", f"{kvgate['rps']:.0f}", f"{row['rps_ratio']:.2f}",
            f"{direct['p50_ms']:.2f}", f"{row['added_p50_ms']:+.2f}", f"{direct['p99_ms']:.2f}",
            f"{row['added_p99_ms']:+.2f}", direct["errors"] + kvgate["errors"], f"{kvgate['busy']['kvgate']:.0%}",
            row["bound"])


def _stream_cpu_table(cpu: dict[str, Any]) -> list[str]:
    ratio = "n/a" if cpu["kvgate_over_stub"] is None else f"{cpu['kvgate_over_stub']:.2f}"
    return table(("streamed chunks", "wall s", "kvgate CPU s / 10k chunks", "stub CPU s / 10k chunks", "kvgate / stub"),
                 [(cpu["chunks"], f"{cpu['wall_s']:.1f}", f"{cpu['kvgate_cpu_s_per_10k_chunks']:.3f}",
                   f"{cpu['stub_cpu_s_per_10k_chunks']:.3f}", ratio)])


def _profile_lines(profiles: dict[str, Any]) -> list[str]:
    lines = []
    for load, profile in profiles.items():
        if profile is None:
            lines.append(f"- {load}: no profile (py-spy missing or not permitted)")
            continue
        own = ", ".join(f"`{frame}` {share:.0%}" for frame, share in profile["top_self"][:6])
        ours = ", ".join(f"`{frame}` {share:.0%}" for frame, share in profile["top_by_kvgate_caller"][:6])
        lines.append(f"- {load} ({profile['samples']} busy samples). Self time: {own}.")
        lines.append(f"  By the deepest kvgate function on the stack (the library work it calls included): {ours}.")
    return lines


def limits_sentence(report: dict[str, Any]) -> str:
    """Which process bounded the closed-loop runs through kvgate, in one sentence."""
    bounds = [row["bound"] for row in report["rows"] if row["spec"]["rate"] == 0 and row["spec"]["concurrency"] > 1]
    by_kvgate = bounds.count("kvgate CPU")
    generator = report["meta"]["closed_loop_generator"]
    return (f"{by_kvgate} of {len(bounds)} closed-loop runs through kvgate were bound by kvgate's own CPU core "
            f"(busy >= 85%); the rest by the core shared by the {generator} load generator and the stub replicas, "
            f"so there kvgate's throughput is a lower bound. Open-loop and single-request rows measure latency only.")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: settings, comparison table, streaming CPU, profile, what limits the result."""
    meta = report["meta"]
    lines = [
        "### kvgate's own overhead",
        "",
        f"Measured {meta['date']} by `{meta['command']}` "
        f"on {meta['cpus']} CPUs ({meta['pinning']}). Replicas are instant stubs "
        f"(`kvgate/loadtest/kit/stub.py`), {meta['replicas']} in one process; direct runs hit the first one, "
        f"kvgate (`--policy {meta['policy']}`) spreads over all. Each direct run is followed at once by the same "
        f"load through kvgate ({meta['repeats']} pairs per row, each side keeps its least disturbed run); bodies are {meta['body_bytes']} B chat requests, {meta['variants']} distinct prompts. "
        f"1-minute load average before/after: {meta['loadavg_1m'][0]}/{meta['loadavg_1m'][1]} (the machine is shared).",
        "",
        *table(_COMPARISON, map(_comparison_row, report["rows"])),
        "",
        "CPU to relay streamed chunks (kvgate's process vs the stub that produced them, same run):",
        "",
        *_stream_cpu_table(report["stream_cpu"]),
        "",
        f"What limits the result: {limits_sentence(report)}",
    ]
    if report.get("profiles"):
        lines += ["", "Where kvgate's CPU goes (py-spy, share of busy samples):", "", *_profile_lines(report["profiles"])]
    return "\n".join(lines) + "\n"


BODY_BYTES = 4096
LARGE_BODY_BYTES = 200 * 1024
OPEN_LOOP_RATE = 500.0
STREAM_CHUNKS = 16
REPLICAS = 2
POLICY = "cache-aware"


@dataclass(frozen=True)
class Plan:
    """How long each part runs."""

    closed_s: float
    warmup_s: float
    open_s: float
    serial_requests: int
    large_requests: int
    stream_cpu_s: float
    profile_s: float  # 0: no profile
    repeats: int  # direct/kvgate pairs per row; each side keeps its least disturbed run


FULL = Plan(closed_s=3, warmup_s=1, open_s=6, serial_requests=300, large_requests=100, stream_cpu_s=8, profile_s=5,
            repeats=2)
QUICK = Plan(closed_s=0.7, warmup_s=0.2, open_s=1, serial_requests=40, large_requests=15, stream_cpu_s=1, profile_s=0,
             repeats=1)


def comparison_specs(plan: Plan) -> list[tuple[str, LoadSpec, bool]]:
    """(row name, load, whether it is a closed loop the chosen generator runs) for each comparison row."""
    base = LoadSpec(url="", body_bytes=BODY_BYTES, chunks=STREAM_CHUNKS, warmup_s=plan.warmup_s)
    serial = dataclasses.replace(base, concurrency=1, duration_s=120.0)
    rows = [(f"4 KB chat, {f'streamed ({STREAM_CHUNKS} chunks)' if stream else 'non-streaming'}, {concurrency} "
             "concurrent", dataclasses.replace(base, stream=stream, concurrency=concurrency, duration_s=plan.closed_s),
             True) for stream in (False, True) for concurrency in (32, 128)]
    return rows + [
        (f"4 KB chat, open loop {OPEN_LOOP_RATE:.0f} req/s",
         dataclasses.replace(base, rate=OPEN_LOOP_RATE, duration_s=plan.open_s), False),
        ("4 KB chat, one at a time", dataclasses.replace(serial, max_requests=plan.serial_requests), False),
        ("200 KB chat, one at a time", dataclasses.replace(serial, body_bytes=LARGE_BODY_BYTES, variants=16,
                                                           max_requests=plan.large_requests), False),
    ]


def stream_cpu_spec(plan: Plan) -> LoadSpec:
    """Many streamed chunks, spaced like decoded tokens so that each reaches kvgate as its own read."""
    return LoadSpec(url="", stream=True, chunks=64, chunk_interval_ms=2.0, concurrency=32,
                    duration_s=plan.stream_cpu_s)


def choose_generator(requested: str) -> str:
    """The closed-loop load generator: wrk when asked for or available ('auto'), else the Python one."""
    if requested == "wrk" and not wrk_available():
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    return "wrk" if requested == "wrk" or (requested == "auto" and wrk_available()) else "python"


async def run_benchmark(plan: Plan, generator: str, profile: bool, scratch: Path, command: str) -> dict[str, Any]:
    """Start the rig, run every part, and return the report as JSON-ready data."""
    run = RunMeta()
    async with running_rig(REPLICAS, POLICY, scratch) as rig:
        rows = [rig.compare(name, spec, generator if closed else "python", plan.repeats)
                for name, spec, closed in comparison_specs(plan)]
        stream_cpu = rig.stream_cpu(stream_cpu_spec(plan))
        profiles: dict[str, Any] = {}
        py_spy = py_spy_path()
        if profile and plan.profile_s and py_spy:
            loads = {"non-streaming, 32 concurrent": LoadSpec(url="", duration_s=plan.profile_s),
                     "streamed 64 chunks, 32 concurrent": stream_cpu_spec(plan)}
            for n, (label, spec) in enumerate(loads.items()):
                spec = dataclasses.replace(spec, duration_s=plan.profile_s)
                found = rig.profile(spec, py_spy, scratch / f"profile-{n}.txt", "python" if spec.stream else generator)
                profiles[label] = found.to_json() if found else None
        meta = run.finish(command=command, pinning=rig.pinning(), replicas=REPLICAS, policy=POLICY,
                          body_bytes=BODY_BYTES, variants=LoadSpec(url="").variants, closed_loop_generator=generator,
                          aiohttp=aiohttp.__version__, repeats=plan.repeats)
    return {"meta": meta, "rows": rows, "stream_cpu": stream_cpu, "profiles": profiles}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The load generator and the profile."""
    parser.add_argument("--client", choices=("auto", "wrk", "python"), default="auto",
                        help="closed-loop load generator (auto: wrk when installed)")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")


def run(options: argparse.Namespace) -> int:
    """Run the benchmark, write overhead.{json,md} and the docs section, print the Markdown."""
    plan = with_knobs(options, QUICK if options.quick else FULL, {"closed_s": "duration", "open_s": "duration"})
    with tempfile.TemporaryDirectory(prefix="kvgate-overhead-") as scratch:
        report = asyncio.run(run_benchmark(plan, choose_generator(options.client), not options.no_profile,
                                           Path(scratch), options.command))
    publish(options.out, "overhead", report, render_markdown(report), options.docs)
    return 0
