"""Sampling a process's resident memory, open descriptors and CPU at a fixed interval."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

import psutil


@dataclass(frozen=True, slots=True)
class ResourceSample:
    """One reading of a process; `t` in seconds since sampling began."""

    t: float
    rss_mb: float
    fds: int
    cpu: float  # share of one core used since the previous sample

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


class ProcessSampler:
    """Reads RSS (VmRSS), the open-descriptor count and CPU time of one process every `interval` seconds."""

    def __init__(self, pid: int, interval: float) -> None:
        self._process = psutil.Process(pid)
        self._interval = interval
        self.samples: list[ResourceSample] = []

    def sample(self, t: float, cpu: float) -> ResourceSample:
        """Read the process now."""
        with self._process.oneshot():
            reading = ResourceSample(t=round(t, 2), rss_mb=round(self._process.memory_info().rss / 2**20, 2),
                                     fds=self._process.num_fds(), cpu=round(cpu, 3))
        return reading

    async def run(self, seconds: float) -> None:
        """Sample until `seconds` have passed or the task is cancelled (the process exiting ends it too)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        last_wall, last_cpu = start, self._cpu_seconds()
        try:
            while loop.time() - start <= seconds:
                now, cpu_seconds = loop.time(), self._cpu_seconds()
                busy = (cpu_seconds - last_cpu) / (now - last_wall) if now > last_wall else 0.0
                self.samples.append(self.sample(now - start, busy))
                last_wall, last_cpu = now, cpu_seconds
                await asyncio.sleep(self._interval)
        except psutil.NoSuchProcess:
            return

    def _cpu_seconds(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system
