"""The rig (stub replicas + kvgate, pinned) and the measurements taken on it: direct vs through kvgate.

The load generators run as blocking subprocesses: nothing else runs on the event loop meanwhile.
"""

from __future__ import annotations

import dataclasses
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from kvgate.loadtest.kit.processes import ChildProcess, cpu_layout, pinned, start_gateway, start_stub, stopping
from kvgate.loadtest.overhead.load import LoadResult, LoadSpec
from kvgate.loadtest.overhead.profile import Profile, Recorder
from kvgate.loadtest.overhead.wrk import run_wrk

BUSY = 0.85  # a process using this share of its core or more is what bounds a run


@dataclass(frozen=True)
class Comparison:
    """The same load sent directly to a replica and through kvgate."""

    name: str
    spec: LoadSpec
    direct: LoadResult
    kvgate: LoadResult

    @property
    def errors(self) -> int:
        """Failed requests in both runs."""
        return self.direct.errors + self.kvgate.errors

    @property
    def rps_ratio(self) -> float:
        """kvgate's throughput over the direct one (1.0: no loss)."""
        return self.kvgate.rps / self.direct.rps if self.direct.rps else 0.0

    @property
    def added_p50_ms(self) -> float:
        """Median latency kvgate adds."""
        return self.kvgate.p50_ms - self.direct.p50_ms

    @property
    def added_p99_ms(self) -> float:
        """99th-percentile latency kvgate adds."""
        return self.kvgate.p99_ms - self.direct.p99_ms

    def bound(self) -> str:
        """What limited the run through kvgate: its own core, the shared core of client and stub, or neither."""
        busy = self.kvgate.busy
        if busy.get("kvgate", 0.0) >= BUSY:
            return "kvgate CPU"
        if busy.get("client", 0.0) + busy.get("stub", 0.0) >= BUSY:
            return "client+stub CPU"
        return "not CPU"

    def to_json(self) -> dict:
        """The comparison with its derived numbers, as plain JSON."""
        return {"name": self.name, "spec": self.spec.to_json(), "direct": self.direct.to_json(),
                "kvgate": self.kvgate.to_json(), "rps_ratio": round(self.rps_ratio, 3),
                "added_p50_ms": round(self.added_p50_ms, 3), "added_p99_ms": round(self.added_p99_ms, 3),
                "bound": self.bound()}


@dataclass(frozen=True)
class StreamCpu:
    """CPU that kvgate and the stub spent relaying the same streamed chunks."""

    chunks: int
    wall_s: float
    kvgate_cpu_s: float
    stub_cpu_s: float
    errors: int

    def per_10k(self, cpu_s: float) -> float:
        """CPU seconds per 10,000 chunks."""
        return cpu_s / self.chunks * 10_000 if self.chunks else 0.0

    def to_json(self) -> dict:
        """The measurement with per-10k figures and the ratio, as plain JSON."""
        return {**dataclasses.asdict(self), "kvgate_cpu_s_per_10k_chunks": round(self.per_10k(self.kvgate_cpu_s), 4),
                "stub_cpu_s_per_10k_chunks": round(self.per_10k(self.stub_cpu_s), 4),
                "kvgate_over_stub": round(self.kvgate_cpu_s / self.stub_cpu_s, 2) if self.stub_cpu_s else None}


def _least_disturbed(runs: list[LoadResult]) -> LoadResult:
    """The run with the lowest median latency, preferring runs without errors."""
    return min(runs, key=lambda run: (run.errors > 0, run.p50_ms))


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's finished, waited-for children (the load generators)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@asynccontextmanager
async def running_rig(replicas: int, policy: str, log_dir: Path) -> AsyncIterator[Rig]:
    """Stub replicas in one process and kvgate in front of them, each pinned when two CPUs are usable."""
    gateway_cpu, other_cpu = cpu_layout()
    stub, replica_urls = await start_stub("stub", replicas, log_dir, other_cpu)
    async with stopping(stub):
        kvgate, gateway_url = await start_gateway("kvgate", replica_urls, ["--policy", policy], log_dir, gateway_cpu)
        async with stopping(kvgate):
            yield Rig(stub, kvgate, replica_urls, gateway_url, gateway_cpu, other_cpu)


class Rig:
    """The running stubs and kvgate, and the measurements taken on them: direct vs through kvgate."""

    def __init__(self, stub: ChildProcess, kvgate: ChildProcess, replica_urls: list[str], gateway_url: str,
                 gateway_cpu: int | None, other_cpu: int | None) -> None:
        self.stub, self.kvgate = stub, kvgate
        self.replica_urls, self.gateway_url = replica_urls, gateway_url
        self.gateway_cpu, self.other_cpu = gateway_cpu, other_cpu

    def pinning(self) -> str:
        """How processes share the CPUs, in words."""
        if self.gateway_cpu is None:
            return "not pinned (fewer than two usable CPUs)"
        return f"kvgate on CPU {self.gateway_cpu}; stub replicas, load generator and py-spy on CPU {self.other_cpu}"

    def _cpu_seconds(self) -> dict[str, float]:
        return {"kvgate": self.kvgate.cpu_seconds(), "stub": self.stub.cpu_seconds(),
                "client": _children_cpu_seconds()}

    def _wrk(self, spec: LoadSpec) -> LoadResult:
        """A warm-up wrk run, then the measured one with each process's CPU charged over it."""
        if spec.warmup_s:
            run_wrk(dataclasses.replace(spec, duration_s=spec.warmup_s), self.other_cpu)
        before, started = self._cpu_seconds(), time.perf_counter()
        result = run_wrk(spec, self.other_cpu)
        wall, after = time.perf_counter() - started, self._cpu_seconds()
        return dataclasses.replace(result, busy={name: round((after[name] - before[name]) / wall, 3)
                                                 for name in before})

    def _python(self, spec: LoadSpec) -> LoadResult:
        """The Python generator in its own process; it charges CPU over its own measured stretch."""
        assert self.kvgate.pid is not None and self.stub.pid is not None, "the rig is stopped"
        spec = dataclasses.replace(spec, watch=(("kvgate", self.kvgate.pid), ("stub", self.stub.pid)))
        command = pinned([sys.executable, "-m", "kvgate.loadtest.overhead.pyclient",
                          orjson.dumps(spec.to_json()).decode()], self.other_cpu)
        done = subprocess.run(command, capture_output=True, text=True, check=True,
                              timeout=spec.warmup_s + spec.duration_s + 120)
        return LoadResult.from_json(orjson.loads(done.stdout.splitlines()[-1]))

    def measure(self, spec: LoadSpec, generator: str) -> LoadResult:
        """Run one load with `generator` ("wrk" or "python")."""
        return self._wrk(spec) if generator == "wrk" else self._python(spec)

    def compare(self, name: str, spec: LoadSpec, generator: str, repeats: int = 1) -> Comparison:
        """The load sent to the first replica, then the same load through kvgate, `repeats` times in turn.

        Each side keeps its run with the lowest median latency: other work on a shared machine only ever
        slows a run down, so the best of a few is the closest to the undisturbed number.
        """
        direct, through = [], []
        for _ in range(repeats):
            direct.append(self.measure(dataclasses.replace(spec, url=self.replica_urls[0]), generator))
            through.append(self.measure(dataclasses.replace(spec, url=self.gateway_url), generator))
        return Comparison(name, spec, _least_disturbed(direct), _least_disturbed(through))

    def stream_cpu(self, spec: LoadSpec) -> StreamCpu:
        """A streaming run through kvgate with no warm-up, so every chunk sent is counted."""
        spec = dataclasses.replace(spec, url=self.gateway_url, stream=True, warmup_s=0.0)
        kvgate_before, stub_before = self.kvgate.cpu_seconds(), self.stub.cpu_seconds()
        started = time.perf_counter()
        result = self._python(spec)
        wall = time.perf_counter() - started
        return StreamCpu(chunks=result.requests * spec.chunks, wall_s=round(wall, 3),
                         kvgate_cpu_s=round(self.kvgate.cpu_seconds() - kvgate_before, 3),
                         stub_cpu_s=round(self.stub.cpu_seconds() - stub_before, 3), errors=result.errors)

    def profile(self, spec: LoadSpec, py_spy: str, output: Path, generator: str) -> Profile | None:
        """Sample kvgate with py-spy while the spec's load runs through it."""
        spec = dataclasses.replace(spec, url=self.gateway_url, warmup_s=0.0)
        assert self.kvgate.pid is not None, "the rig is stopped"
        recorder = Recorder(py_spy, self.kvgate.pid, spec.duration_s, output, self.other_cpu)
        self.measure(spec, generator)
        return recorder.finish()
