"""The rig (stub replicas + kvgate, pinned) and the measurements taken on it: direct vs through kvgate."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from kvgate.loadtest.overhead.load import LoadResult, LoadSpec
from kvgate.loadtest.overhead.processes import Service, children_cpu_seconds, cpu_layout, free_port, pinned
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


class Rig:
    """Stub replicas in one process and kvgate in front of them, each pinned when two CPUs are usable."""

    def __init__(self, replicas: int = 2, policy: str = "cache-aware", gateway_args: tuple[str, ...] = ()) -> None:
        self.gateway_cpu, self.other_cpu = cpu_layout()
        ports = [free_port() for _ in range(replicas)]
        self.replica_urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.stub = Service("stub", [sys.executable, "-m", "kvgate.loadtest.overhead.stub",
                                     "--ports", ",".join(map(str, ports))], self.other_cpu)
        gateway_port = free_port()
        self.gateway_url = f"http://127.0.0.1:{gateway_port}"
        self.kvgate = Service("kvgate", [
            sys.executable, "-m", "kvgate.router.cli", "serve", "--listen", f"127.0.0.1:{gateway_port}",
            "--endpoints", ",".join(self.replica_urls), "--policy", policy, "--log-level", "warning",
            "--drain-delay", "0", "--drain-timeout", "1", *gateway_args], self.gateway_cpu)
        try:
            for url in self.replica_urls:
                self.stub.wait_ready(url + "/v1/models")
            self.kvgate.wait_ready(self.gateway_url + "/readyz")
        except BaseException:
            self.close()
            raise

    def pinning(self) -> str:
        """How processes share the CPUs, in words."""
        if self.gateway_cpu is None:
            return "not pinned (fewer than two usable CPUs)"
        return f"kvgate on CPU {self.gateway_cpu}; stub replicas, load generator and py-spy on CPU {self.other_cpu}"

    def close(self) -> None:
        """Stop kvgate, then the stubs."""
        self.kvgate.stop()
        self.stub.stop()

    def _cpu_seconds(self) -> dict[str, float]:
        return {"kvgate": self.kvgate.cpu_seconds(), "stub": self.stub.cpu_seconds(),
                "client": children_cpu_seconds()}

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
        recorder = Recorder(py_spy, self.kvgate.pid, spec.duration_s, output, self.other_cpu)
        self.measure(spec, generator)
        return recorder.finish()
