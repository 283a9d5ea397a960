"""`kvgate bench rolling`: replace every replica under steady streaming load and count what failed; each scenario
on a fresh fleet and gateway, all in this process, TTFT compared before, during and after the restart."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp

from kvgate.loadtest.cli import with_knobs
from kvgate.loadtest.kit.report import publish, table, utc_now
from kvgate.loadtest.kit.stats import ms
from kvgate.loadtest.kit.stream import RequestSample, stream_chat
from kvgate.loadtest.rolling.fleet import (
    ControlledDiscovery,
    RestartRecord,
    RestartTiming,
    RollingRestart,
    start_replicas,
)
from kvgate.loadtest.routing.workload import system_prompt
from kvgate.router.config import build_config
from kvgate.router.gateway import Gateway
from kvgate.router.server import GatewayServer
from kvgate.simulator import SimOptions

_REQUEST_TIMEOUT_SECONDS = 30.0
_SYSTEM_PROMPT_CHARS = 800


class SteadyLoad:
    """`concurrency` clients streaming chats through `url`, bounded in count and time, over `tenants` prompts."""

    def __init__(self, url: str, model: str, concurrency: int, max_requests: int, max_seconds: float,
                 max_tokens: int, tenants: int = 16) -> None:
        self.samples: list[RequestSample] = []
        self.run_start = 0.0  # event loop time the run began; samples' `start` is relative to it
        self._url = url
        self._model = model
        self._concurrency = concurrency
        self._max_requests = max_requests
        self._max_seconds = max_seconds
        self._max_tokens = max_tokens
        self._prompts = [system_prompt(tenant, _SYSTEM_PROMPT_CHARS) for tenant in range(tenants)]
        self._numbers = itertools.count()
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Let every client finish its current request and send no more."""
        self._stopping.set()

    async def run(self) -> list[RequestSample]:
        """Run the clients until stopped, `max_requests` were sent, or `max_seconds` passed."""
        loop = asyncio.get_running_loop()
        self.run_start = loop.time()
        deadline = self.run_start + self._max_seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(self._client(session, deadline) for _ in range(self._concurrency)))
        return self.samples

    async def _client(self, session: aiohttp.ClientSession, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set() and loop.time() < deadline:
            number = next(self._numbers)
            if number >= self._max_requests:
                return
            body = {"model": self._model, "max_tokens": self._max_tokens, "stream": True,
                    "messages": [{"role": "system", "content": self._prompts[number % len(self._prompts)]},
                                 {"role": "user", "content": f"Question {number}: where is my order?"}]}
            sample, _ = await stream_chat(session, self._url, body, self.run_start, _REQUEST_TIMEOUT_SECONDS)
            self.samples.append(sample)


@dataclass(frozen=True, slots=True)
class Plan:
    """Fleet, load and timings of one benchmark."""

    replicas: int
    clients: int
    max_tokens: int
    warmup_s: float  # load before the "before" window opens: the first burst of clients is not steady state
    before_s: float  # steady load before the restart begins
    after_s: float  # steady load after the last replacement is ready
    startup_s: float  # a replacement's model load, during which it accepts connections but does not answer
    propagation_s: float  # preStop sleep, or how late discovery is
    sim: SimOptions = SimOptions(speed=2.0, max_model_len=4096)


QUICK = Plan(replicas=3, clients=24, max_tokens=48, warmup_s=1.0, before_s=3.0, after_s=1.0, startup_s=0.5,
             propagation_s=0.2)
FULL = Plan(replicas=4, clients=40, max_tokens=64, warmup_s=2.0, before_s=8.0, after_s=3.0, startup_s=2.0,
            propagation_s=0.5)


@dataclass(frozen=True, slots=True)
class Scenario:
    """How discovery and the replica's own shutdown are ordered."""

    title: str
    discovery_first: bool


SCENARIOS = (
    Scenario("discovery first (preStop sleep, then SIGTERM)", discovery_first=True),
    Scenario("discovery late (SIGTERM first, endpoint update after)", discovery_first=False),
)


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of one scenario."""

    scenario: Scenario
    samples: list[RequestSample]
    records: list[RestartRecord]
    retries: dict[str, int]  # kvgate_retries_total by cause
    warmup_s: float
    restart_window: tuple[float, float]  # when the restart began and ended, relative to the load's start

    @property
    def failed(self) -> int:
        """Requests without a 200 and a complete stream."""
        return sum(1 for s in self.samples if s.error is not None)

    def phase(self, name: str) -> list[RequestSample]:
        """Requests that started before (after the warm-up), during or after the restart."""
        began, ended = self.restart_window
        bounds = {"before": (self.warmup_s, began), "during": (began, ended), "after": (ended, float("inf"))}
        low, high = bounds[name]
        return [s for s in self.samples if low <= s.start < high]


@asynccontextmanager
async def serving_gateway(discovery: ControlledDiscovery, urls: Sequence[str]) -> AsyncIterator[tuple[str, Gateway]]:
    """kvgate (default policy) on a free loopback port, fed by `discovery`; yields its URL and the gateway."""
    # The URL list only satisfies config validation: `discovery` is the source the gateway follows.
    config = build_config({"listen": "127.0.0.1:0", "endpoints": list(urls), "drain_delay": 0, "drain_timeout": 5})
    server = GatewayServer(config, Gateway(config, discovery))
    await server.start()
    try:
        host, port = server.addresses[0][:2]
        yield f"http://{host}:{port}", server.gateway
    finally:
        await server.drain()


def retries_by_cause(gateway: Gateway) -> dict[str, int]:
    """The gateway's kvgate_retries_total, by cause."""
    return {sample.labels["cause"]: int(sample.value) for family in gateway.metrics.registry.collect()
            for sample in family.samples if sample.name == "kvgate_retries_total"}


async def run_scenario(plan: Plan, scenario: Scenario) -> RunResult:
    """Steady load, a full rolling restart, steady load again; on a fresh fleet and gateway."""
    print(f"running: {scenario.title}", file=sys.stderr)
    replicas = await start_replicas(plan.replicas, plan.sim)
    discovery = ControlledDiscovery()
    replacement = dataclasses.replace(plan.sim, startup_seconds=plan.startup_s * plan.sim.speed)
    timing = RestartTiming(propagation_s=plan.propagation_s, discovery_first=scenario.discovery_first)
    restart = RollingRestart(replicas, discovery.publish, replacement, timing)
    try:
        async with serving_gateway(discovery, [r.url for r in replicas]) as (url, gateway):
            # Bounded by the plan's phases plus a generous allowance for the restart itself.
            max_seconds = plan.warmup_s + plan.before_s + plan.after_s + 120.0
            load = SteadyLoad(url, plan.sim.models[0], plan.clients, max_requests=100_000, max_seconds=max_seconds,
                              max_tokens=plan.max_tokens)
            running = asyncio.create_task(load.run())
            try:
                await asyncio.sleep(plan.warmup_s + plan.before_s)
                records = await restart.restart_all()
                await asyncio.sleep(plan.after_s)
            finally:
                load.stop()
                samples = await running
            retries = retries_by_cause(gateway)
    finally:
        for replica in restart.replicas:
            await replica.stop()
    window = (records[0].began - load.run_start, records[-1].ready - load.run_start)
    return RunResult(scenario, samples, records, retries, plan.warmup_s, window)


def _ttft(samples: list[RequestSample]) -> str:
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    return " / ".join(f"{ms(ttfts, q, 0):.0f}" if ttfts else "-" for q in (50, 99))


def render_markdown(plan: Plan, results: Sequence[RunResult], command: str, seconds: float) -> str:
    """The results as Markdown: setup, one row per scenario, and what each restart drained."""
    sim = plan.sim
    lines = [
        "### Rolling restart of the fleet under load",
        "",
        f"Measured {utc_now()} by `{command}` on {os.cpu_count()} CPUs "
        f"in {seconds:.0f} s; the simulated replicas, kvgate (default policy, retries 1) and the clients share one "
        f"process and event loop, so absolute TTFTs include their contention. Fleet: {plan.replicas} simulated "
        f"replicas (speed {sim.speed}); {plan.clients} clients stream chat completions of {plan.max_tokens} tokens "
        f"back to back. Each replica in turn: marked not ready in discovery and begins vLLM's shutdown "
        f"({plan.propagation_s} s apart, in the order the scenario names; new requests then get vLLM's 503), "
        f"finishes its open streams, closes its port and leaves discovery; its replacement starts on a new port, "
        f"loads for {plan.startup_s} s (connections accepted, nothing answered), is listed not ready, then ready "
        f"once `/health` answers. Load runs {plan.warmup_s + plan.before_s} s before the restart (the first "
        f"{plan.warmup_s} s, warm-up, are left out of \"before\") and {plan.after_s} s after it.",
        "",
        "A request fails unless it gets 200 and a complete stream ending in `[DONE]`. Retried: kvgate's "
        "`kvgate_retries_total` (requests moved to another replica before any byte reached the client).",
        "",
    ]
    rows = []
    for result in results:
        began, ended = result.restart_window
        rows.append((result.scenario.title, len(result.samples), result.failed,
                     ", ".join(f"{n} ({cause})" for cause, n in sorted(result.retries.items())) or "0",
                     f"{ended - began:.1f}", *(_ttft(result.phase(name)) for name in ("before", "during", "after")),
                     sum(r.in_flight_at_shutdown for r in result.records), sum(r.aborted for r in result.records)))
    lines += table(("scenario", "requests", "failed", "retried", "restart s", "TTFT p50 / p99 ms before", "during",
                    "after", "streams open at shutdown", "cut by the replica"), rows)
    errors = sorted({s.error[:120] for r in results for s in r.samples if s.error is not None})
    if errors:
        lines += ["", "Failures seen:", "", *(f"- `{error}`" for error in errors)]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags of its own (--duration is the steady load before the restart)."""


def run(options: argparse.Namespace) -> int:
    """Run both scenarios, write rolling.{json,md} and the docs section; 1 if any request failed."""
    plan = with_knobs(options, QUICK if options.quick else FULL, {"before_s": "duration"})
    started = time.monotonic()
    results = [asyncio.run(run_scenario(plan, scenario)) for scenario in SCENARIOS]
    markdown = render_markdown(plan, results, options.command, time.monotonic() - started)
    report = {"plan": dataclasses.asdict(plan), "scenarios": [
        {"title": r.scenario.title, "requests": len(r.samples), "failed": r.failed, "retries": r.retries,
         "restart_window": r.restart_window} for r in results]}
    publish(options.out, "rolling", report, markdown, options.docs)
    return 1 if any(r.failed for r in results) else 0
