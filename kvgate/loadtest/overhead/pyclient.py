"""The Python load generator (aiohttp on uvloop), run in its own process; prints one LoadResult as JSON.

Run by the overhead scenario as: python -m kvgate.loadtest.overhead.pyclient '{"url": "http://127.0.0.1:9001", "concurrency": 32}'
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import aiohttp
import orjson
import uvloop

from kvgate.loadtest.kit.processes import process_cpu_seconds
from kvgate.loadtest.kit.stats import percentile
from kvgate.loadtest.kit.stream import CHAT_PATH
from kvgate.loadtest.overhead.bodies import chat_bodies
from kvgate.loadtest.overhead.load import LoadResult, LoadSpec


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
