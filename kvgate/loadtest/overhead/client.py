"""The overhead benchmark's load: what one run sends and measured, and the Python generator that sends it, run in
a process of its own: python -m kvgate.loadtest.overhead.client '{"url": ...}'"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
import uvloop

from kvgate.loadtest.kit.processes import process_cpu_seconds
from kvgate.loadtest.kit.stats import ms
from kvgate.loadtest.kit.stream import CHAT_PATH
from kvgate.loadtest.kit.stub import stub_headers
from kvgate.loadtest.kit.vllm_metrics_page import DEFAULT_MODEL

_SYSTEM = "You are a careful assistant. Answer briefly and cite the documents you were given."
_WORDS = "the quick brown fox jumps over the lazy dog "


def chat_bodies(size_bytes: int, count: int, stream: bool) -> list[bytes]:
    """`count` chat bodies of `size_bytes` bytes each, distinct after a shared system prompt like real traffic."""
    bodies = []
    for n in range(count):
        body = {"model": DEFAULT_MODEL, "stream": stream, "max_tokens": 16,
                "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": ""}]}
        room = size_bytes - len(orjson.dumps(body))
        body["messages"][1]["content"] = (f"request {n}: " + _WORDS * (room // len(_WORDS) + 1))[:max(room, 0)]
        bodies.append(orjson.dumps(body))
    return bodies


@dataclass(frozen=True)
class LoadSpec:
    """One load run against one base URL: closed loop at `concurrency`, or open loop at `rate` req/s."""

    url: str
    body_bytes: int = 4096
    stream: bool = False
    chunks: int = 16  # SSE events per streamed answer
    chunk_interval_ms: float = 0.0
    concurrency: int = 32
    rate: float = 0.0  # > 0: open loop, requests sent on schedule whatever the answers do
    duration_s: float = 5.0
    max_requests: int = 0  # > 0: stop after this many measured requests
    warmup_s: float = 0.5  # requests started in this first stretch are not measured
    variants: int = 256  # distinct bodies cycled through
    watch: tuple[tuple[str, int], ...] = ()  # (name, pid) of processes whose CPU to charge over the measured stretch

    def headers(self) -> dict[str, str]:
        """Request headers, including the stub's streaming knobs (which kvgate forwards unchanged)."""
        return stub_headers(self.chunks, self.chunk_interval_ms)

    def to_json(self) -> dict:
        """The spec as plain JSON."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LoadResult:
    """Throughput, latency and failures of one run, as seen by the client."""

    generator: str
    requests: int
    errors: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    first_error: str = ""
    busy: dict[str, float] = field(default_factory=dict)  # CPU seconds per wall second, by process name

    @property
    def rps(self) -> float:
        """Completed requests per second over the measured stretch."""
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> dict:
        """The result as plain JSON, with the derived rate."""
        return {**dataclasses.asdict(self), "rps": round(self.rps, 1)}


def _cpu_seconds(spec: LoadSpec) -> dict[str, float]:
    """CPU seconds so far of each watched process and of this client."""
    return {**{name: process_cpu_seconds(pid) for name, pid in spec.watch}, "client": time.process_time()}


async def run(spec: LoadSpec) -> LoadResult:
    """Run the load the spec describes: latencies and failures of the requests started after the warm-up."""
    bodies = itertools.cycle(chat_bodies(spec.body_bytes, spec.variants, spec.stream))
    latencies: list[float] = []
    errors: list[str] = []

    async def one(session: aiohttp.ClientSession, started: float, measure_from: float) -> None:
        """Send one request, read the whole answer, and count it if it started (or was due) after the warm-up."""
        try:
            async with session.post(spec.url + CHAT_PATH, data=next(bodies), headers=spec.headers()) as response:
                await response.read()
                error = "" if response.status == 200 else f"status {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = type(exc).__name__
        if started >= measure_from and error:
            errors.append(error)
        elif started >= measure_from:
            latencies.append(time.perf_counter() - started)

    def enough() -> bool:
        return bool(spec.max_requests) and len(latencies) + len(errors) >= spec.max_requests

    connector = aiohttp.TCPConnector(limit=0 if spec.rate else spec.concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        measure_from = time.perf_counter() + spec.warmup_s
        end = measure_from + spec.duration_s
        cpu_before = asyncio.create_task(_cpu_seconds_after(spec.warmup_s, spec))
        if spec.rate:  # open loop: latency counts from the scheduled time, so queueing shows
            await _open_loop(spec.rate, measure_from - spec.warmup_s, end,
                             lambda scheduled: one(session, scheduled, measure_from))
        else:
            async def worker() -> None:  # closed loop: the next request as soon as the last one is answered
                while time.perf_counter() < end and not enough():
                    await one(session, time.perf_counter(), measure_from)

            await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        finished = time.perf_counter()
        before, after = await cpu_before, _cpu_seconds(spec)
    window = finished - measure_from
    return LoadResult(generator="python-aiohttp", requests=len(latencies), errors=len(errors),
                      duration_s=round(window, 3), p50_ms=ms(latencies, 50, 3), p99_ms=ms(latencies, 99, 3),
                      first_error=errors[0] if errors else "",
                      busy={name: round((after[name] - before[name]) / window, 3) for name in after})


async def _cpu_seconds_after(delay_s: float, spec: LoadSpec) -> dict[str, float]:
    """`_cpu_seconds` when the warm-up ends."""
    await asyncio.sleep(delay_s)
    return _cpu_seconds(spec)


async def _open_loop(rate: float, start: float, end: float, send: Callable[[float], Awaitable[None]]) -> None:
    """`send(scheduled)` at `rate` per second from `start` until `end`, whatever the answers do."""
    tasks = []
    for scheduled in itertools.takewhile(lambda at: at < end, (start + n / rate for n in itertools.count())):
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        tasks.append(asyncio.create_task(send(scheduled)))
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    print(orjson.dumps(uvloop.run(run(LoadSpec(**orjson.loads(sys.argv[1])))).to_json()).decode())
