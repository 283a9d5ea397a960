"""Chat request bodies of an exact size, distinct after a shared system prompt like real traffic."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
import uvloop

from kvgate.loadtest.kit.processes import process_cpu_seconds
from kvgate.loadtest.kit.stats import percentile
from kvgate.loadtest.kit.stream import CHAT_PATH
from kvgate.loadtest.kit.vllm_metrics_page import DEFAULT_MODEL

_SYSTEM = "You are a careful assistant. Answer briefly and cite the documents you were given."
_WORDS = "the quick brown fox jumps over the lazy dog "


def chat_bodies(size_bytes: int, count: int, stream: bool) -> list[bytes]:
    """`count` chat bodies of `size_bytes` bytes each; each user message starts with its own number."""
    bodies = []
    for n in range(count):
        body = {"model": DEFAULT_MODEL, "stream": stream, "max_tokens": 16,
                "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": ""}]}
        room = size_bytes - len(orjson.dumps(body))
        text = f"request {n}: " + _WORDS * (room // len(_WORDS) + 1)
        body["messages"][1]["content"] = text[:max(room, 0)]
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
        return {"Content-Type": "application/json", "x-bench-chunks": str(self.chunks),
                "x-bench-chunk-interval-ms": str(self.chunk_interval_ms)}

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

    @classmethod
    def from_json(cls, data: dict) -> LoadResult:
        """Rebuild a result from `to_json` output."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


class _Tally:
    """Latencies and failures of the measured requests."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors = 0
        self.first_error = ""

    def fail(self, reason: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or reason


def _cpu_seconds(spec: LoadSpec) -> dict[str, float]:
    """CPU seconds so far of each watched process and of this client."""
    return {**{name: process_cpu_seconds(pid) for name, pid in spec.watch}, "client": time.process_time()}


async def _cpu_seconds_after(delay_s: float, spec: LoadSpec) -> dict[str, float]:
    """`_cpu_seconds` when the warm-up ends."""
    await asyncio.sleep(delay_s)
    return _cpu_seconds(spec)


async def _one(session: aiohttp.ClientSession, spec: LoadSpec, body: bytes) -> str:
    """Send one request and read the whole answer; returns an error description, empty on success."""
    try:
        async with session.post(spec.url + CHAT_PATH, data=body, headers=spec.headers()) as response:
            await response.read()
            return "" if response.status == 200 else f"status {response.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return type(exc).__name__


async def _closed_loop(session: aiohttp.ClientSession, spec: LoadSpec, bodies: itertools.cycle,
                       tally: _Tally, measure_from: float, end: float) -> None:
    """`concurrency` workers, each sending its next request as soon as the last one is answered."""
    async def worker() -> None:
        while time.perf_counter() < end:
            if spec.max_requests and len(tally.latencies) + tally.errors >= spec.max_requests:
                return
            started = time.perf_counter()
            error = await _one(session, spec, next(bodies))
            if started < measure_from:
                continue
            if error:
                tally.fail(error)
            else:
                tally.latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))


async def _open_loop(session: aiohttp.ClientSession, spec: LoadSpec, bodies: itertools.cycle,
                     tally: _Tally, measure_from: float, end: float) -> None:
    """Requests sent on a fixed schedule; latency counts from the scheduled time, so queueing shows."""
    async def timed(scheduled: float) -> None:
        error = await _one(session, spec, next(bodies))
        if scheduled < measure_from:
            return
        if error:
            tally.fail(error)
        else:
            tally.latencies.append(time.perf_counter() - scheduled)

    start = time.perf_counter()
    tasks = []
    for n in itertools.count():
        scheduled = start + n / spec.rate
        if scheduled >= end:
            break
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        tasks.append(asyncio.create_task(timed(scheduled)))
    await asyncio.gather(*tasks)


async def run(spec: LoadSpec) -> LoadResult:
    """Run the load the spec describes and tally it."""
    bodies = itertools.cycle(chat_bodies(spec.body_bytes, spec.variants, spec.stream))
    tally = _Tally()
    connector = aiohttp.TCPConnector(limit=0 if spec.rate else spec.concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        start = time.perf_counter()
        measure_from = start + spec.warmup_s
        end = measure_from + spec.duration_s
        cpu_at_start = asyncio.create_task(_cpu_seconds_after(spec.warmup_s, spec))
        loop = _open_loop if spec.rate else _closed_loop
        await loop(session, spec, bodies, tally, measure_from, end)
        finished = time.perf_counter()
        cpu_before, cpu_after = await cpu_at_start, _cpu_seconds(spec)
    window = finished - measure_from
    busy = {name: round((cpu_after[name] - cpu_before[name]) / window, 3) for name in cpu_after}
    return LoadResult(generator="python-aiohttp", requests=len(tally.latencies), errors=tally.errors,
                      duration_s=round(window, 3), p50_ms=_ms(tally.latencies, 50),
                      p99_ms=_ms(tally.latencies, 99), first_error=tally.first_error, busy=busy)


def _ms(latencies_s: list[float], q: int) -> float:
    """The q-th percentile of latencies in seconds, in milliseconds; 0 for an empty run."""
    return round((percentile(latencies_s, q) or 0.0) * 1000, 3)


def main() -> None:
    """Read the spec from argv, print the result."""
    spec = LoadSpec(**orjson.loads(sys.argv[1]))
    print(orjson.dumps(uvloop.run(run(spec)).to_json()).decode())


if __name__ == "__main__":
    main()
