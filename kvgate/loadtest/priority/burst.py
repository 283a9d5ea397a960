"""`kvgate bench burst`: many streams opened at once on an idle fleet with room to spare; admission must not hold a
request the fleet can take now, so kvgate's TTFT is compared with other routers' (--external) in the same run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
from typing import Any

import aiohttp

from kvgate.loadtest.cli import add_external_argument
from kvgate.loadtest.kit.processes import running, start_external, start_gateway, start_sim_fleet
from kvgate.loadtest.kit.report import RunMeta, publish, table
from kvgate.loadtest.kit.stats import ms
from kvgate.loadtest.kit.stream import stream_chat
from kvgate.simulator import SimOptions

# Thousands of seats and a KV cache to match: nothing in the fleet is saturated by the burst.
ROOMY = SimOptions(max_num_seqs=4000, num_gpu_blocks=200_000, default_max_tokens=16)
_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The burst's size, the rounds and the routers to compare with."""
    parser.add_argument("--streams", type=int, default=1000, help="streams opened at once")
    parser.add_argument("--rounds", type=int, default=3, help="bursts through each router, in turn")
    add_external_argument(parser)


async def burst(url: str, streams: int, model: str) -> dict[str, Any]:
    """Open `streams` streamed chats at once through `url`; their TTFT percentiles and failures."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await asyncio.gather(*(
            stream_chat(session, url, {"model": model, "messages": [{"role": "user", "content": f"burst {i}"}],
                                       "max_tokens": 16, "stream": True}, start, _TIMEOUT_S)
            for i in range(streams)))
    ttfts = [sample.ttft for sample, _ in results if sample.error is None and sample.ttft is not None]
    return {"ok": len(ttfts), "failed": streams - len(ttfts), "ttft_p50_ms": ms(ttfts, 50),
            "ttft_p99_ms": ms(ttfts, 99)}


async def _measure(options: argparse.Namespace) -> dict[str, Any]:
    log_dir = options.out / "logs"
    streams, rounds = (50, 1) if options.quick else (options.streams, options.rounds)
    async with contextlib.AsyncExitStack() as stack:
        workers = await stack.enter_async_context(running(start_sim_fleet("burst-sim", 3, ROOMY, log_dir)))
        routers = {"kvgate": await stack.enter_async_context(running(start_gateway("burst-kvgate", workers, [],
                                                                                  log_dir)))}
        for name, template in options.external:
            started = start_external(f"burst-{name}", template, workers, log_dir)
            routers[name] = await stack.enter_async_context(running(started))
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in routers}
        for _, (name, target) in itertools.product(range(rounds), routers.items()):
            rows[name].append(await burst(target, streams, ROOMY.models[0]))
            await asyncio.sleep(1.0)  # let the fleet go idle again
    return {"streams": streams, "rounds": rounds, "routers": rows}


def render_markdown(report: dict[str, Any]) -> str:
    """One row per router and round, and kvgate's p99 against each other router's in the same round."""
    routers = report["routers"]
    lines = [f"Measured {report['meta']['date']} by `{report['meta']['command']}` on {report['meta']['cpus']} CPUs "
             f"(load average {report['meta']['loadavg_1m']}): {report['streams']} streams opened at once on 3 idle "
             f"simulated replicas of {ROOMY.max_num_seqs} seats, kvgate with no configuration.", ""]
    rows = []
    for name, rounds in routers.items():
        for number, result in enumerate(rounds, 1):
            ratio = "-" if name == "kvgate" or not result["ttft_p99_ms"] else \
                f"{routers['kvgate'][number - 1]['ttft_p99_ms'] / result['ttft_p99_ms']:.2f}x"
            rows.append((name, number, result["ttft_p50_ms"], result["ttft_p99_ms"], result["failed"], ratio))
    lines += table(("router", "round", "TTFT p50 ms", "TTFT p99 ms", "failed", "kvgate p99 / this p99"), rows)
    return "\n".join(lines) + "\n"


def run(options: argparse.Namespace) -> int:
    """Run the bursts, write burst.{json,md} and the docs section, print the Markdown."""
    meta = RunMeta()
    report = asyncio.run(_measure(options))
    report["meta"] = meta.finish(command=options.command)
    publish(options.out, "burst", report, render_markdown(report), options.docs)
    return 0
