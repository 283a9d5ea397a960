"""Closed-loop load with wrk (C, one thread), which leaves far more CPU to the processes under test."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from kvgate.loadtest.kit.processes import ChildProcess, cpu_layout, pinned, start_gateway, start_stub, stopping
from kvgate.loadtest.kit.stream import CHAT_PATH
from kvgate.loadtest.overhead.client import LoadResult, LoadSpec, chat_bodies

_RESULT_PREFIX = "WRK_RESULT "
# Cycles through the bodies file (one JSON body a line) and prints the summary as one JSON line.
_SCRIPT = """
wrk.method = "POST"
{headers}
local bodies, n = {{}}, 0
for line in io.lines([[{bodies}]]) do bodies[#bodies + 1] = line end
request = function()
  n = n % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[n])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{prefix}{{"requests": %d, "duration_us": %d, "errors": %d, "p50_us": %d, "p99_us": %d}}\\n',
    summary.requests - e.status, summary.duration, e.connect + e.read + e.write + e.timeout + e.status,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_available() -> bool:
    """Whether a wrk binary is on PATH."""
    return shutil.which("wrk") is not None


def _script(spec: LoadSpec, folder: Path) -> Path:
    bodies = folder / "bodies.jsonl"
    bodies.write_bytes(b"\n".join(chat_bodies(spec.body_bytes, spec.variants, spec.stream)) + b"\n")
    headers = "\n".join(f'wrk.headers["{name}"] = "{value}"' for name, value in spec.headers().items())
    script = folder / "chat.lua"
    script.write_text(_SCRIPT.format(headers=headers, bodies=bodies, prefix=_RESULT_PREFIX))
    return script


def run_wrk(spec: LoadSpec, cpu: int | None = None) -> LoadResult:
    """Run wrk for `duration_s` (whole seconds, at least one) of the spec's closed loop; `cpu` pins it.

    The spec's warm-up and `watch` are the caller's business: wrk knows nothing of them.
    """
    if spec.rate or spec.max_requests:
        raise ValueError("wrk runs only duration-bound closed loops")
    seconds = max(1, math.ceil(spec.duration_s))
    with tempfile.TemporaryDirectory(prefix="kvgate-wrk-") as tmp:
        command = pinned(["wrk", "-t1", f"-c{spec.concurrency}", f"-d{seconds}s", "--timeout", "30s",
                          "-s", str(_script(spec, Path(tmp))), spec.url + CHAT_PATH], cpu)
        output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    line = next((ln for ln in output.splitlines() if ln.startswith(_RESULT_PREFIX)), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {output[-500:]}")
    data = json.loads(line[len(_RESULT_PREFIX):])
    return LoadResult(generator="wrk", requests=data["requests"], errors=data["errors"],
                      duration_s=round(data["duration_us"] / 1e6, 3), p50_ms=data["p50_us"] / 1000,
                      p99_ms=data["p99_us"] / 1000, first_error="see wrk" if data["errors"] else "")


KVGATE_PACKAGES = ("kvgate/router/", "kvgate/endpoints/", "kvgate/policies/")
_ENTRY = "(kvgate/router/cli.py)"  # the process's entry frames, on every stack
OUTSIDE_KVGATE = "event loop / aiohttp, no kvgate frame"


def py_spy_path() -> str | None:
    """py-spy next to this interpreter (a venv install) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass(frozen=True)
class Profile:
    """Busy samples of one process: the functions they were in (self), and the kvgate function that caused them."""

    samples: int
    top_self: list[tuple[str, float]]  # (function (file), share of busy samples)
    top_kvgate: list[tuple[str, float]]  # deepest kvgate frame of each sample, libraries it calls included

    def to_json(self) -> dict:
        """The profile as plain JSON."""
        return {"samples": self.samples, "top_self": self.top_self, "top_by_kvgate_caller": self.top_kvgate}


def _deepest_kvgate_frame(frames: list[str]) -> str:
    for frame in reversed(frames):
        if _ENTRY not in frame and any(f"({package}" in frame for package in KVGATE_PACKAGES):
            return frame
    return OUTSIDE_KVGATE


def summarize(raw: str, top: int = 8) -> Profile:
    """Aggregate py-spy's raw (collapsed-stack) output: `frame;frame;... count` per line."""
    own: Counter[str] = Counter()
    caller: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        caller[_deepest_kvgate_frame(frames)] += count

    def shares(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(n / total, 3)) for frame, n in counter.most_common(top)] if total else []

    return Profile(samples=total, top_self=shares(own), top_kvgate=shares(caller))


class Recorder:
    """A py-spy recording of `pid` running in the background for `duration_s` seconds."""

    def __init__(self, py_spy: str, pid: int, duration_s: float, output: Path, cpu: int | None) -> None:
        self._output = output
        command = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))),
                   "--format", "raw", "--nolineno", "--rate", "200", "--output", str(output)]
        self._process = subprocess.Popen(pinned(command, cpu), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finish(self) -> Profile | None:
        """Wait for py-spy and summarize; None when it could not sample (e.g. no ptrace permission)."""
        _, stderr = self._process.communicate(timeout=120)
        if self._process.returncode != 0 or not self._output.exists():
            print(f"py-spy failed: {stderr.decode(errors='replace')[-300:]}", file=sys.stderr)
            return None
        return summarize(self._output.read_text())


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
        command = pinned([sys.executable, "-m", "kvgate.loadtest.overhead.client",
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
