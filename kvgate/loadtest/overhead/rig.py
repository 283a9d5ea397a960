"""The overhead rig (stub replicas + kvgate, pinned) and what is measured on it: direct vs through kvgate, CPU per
streamed chunk, and where kvgate's CPU goes (py-spy). The load generators run as blocking subprocesses: nothing
else runs on the event loop meanwhile."""

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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson

from kvgate.loadtest.kit.processes import ChildProcess, cpu_layout, pinned, start_gateway, start_stub, stopping
from kvgate.loadtest.kit.stream import CHAT_PATH
from kvgate.loadtest.overhead.client import LoadResult, LoadSpec, chat_bodies

BUSY = 0.85  # a process using this share of its core or more is what bounds a run
KVGATE_PACKAGES = ("kvgate/router/", "kvgate/endpoints/", "kvgate/policies/")
_ENTRY = "(kvgate/router/cli.py)"  # the process's entry frames, on every stack
OUTSIDE_KVGATE = "event loop / aiohttp, no kvgate frame"
_WRK_PREFIX = "WRK_RESULT "
# Cycles through the bodies file (one JSON body a line) and prints the summary as one JSON line.
_WRK_SCRIPT = """
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
    """Whether a wrk binary (C, one thread: far more CPU left to the processes under test) is on PATH."""
    return shutil.which("wrk") is not None


def run_wrk(spec: LoadSpec, cpu: int | None = None) -> LoadResult:
    """wrk for the spec's closed loop (whole seconds, at least one) pinned to `cpu`; warm-up and `watch` are not its."""
    if spec.rate or spec.max_requests:
        raise ValueError("wrk runs only duration-bound closed loops")
    seconds = max(1, math.ceil(spec.duration_s))
    with tempfile.TemporaryDirectory(prefix="kvgate-wrk-") as tmp:
        bodies, script = Path(tmp) / "bodies.jsonl", Path(tmp) / "chat.lua"
        bodies.write_bytes(b"\n".join(chat_bodies(spec.body_bytes, spec.variants, spec.stream)) + b"\n")
        headers = "\n".join(f'wrk.headers["{name}"] = "{value}"' for name, value in spec.headers().items())
        script.write_text(_WRK_SCRIPT.format(headers=headers, bodies=bodies, prefix=_WRK_PREFIX))
        command = pinned(["wrk", "-t1", f"-c{spec.concurrency}", f"-d{seconds}s", "--timeout", "30s",
                          "-s", str(script), spec.url + CHAT_PATH], cpu)
        output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    line = next((ln for ln in output.splitlines() if ln.startswith(_WRK_PREFIX)), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {output[-500:]}")
    data = json.loads(line[len(_WRK_PREFIX):])
    return LoadResult(generator="wrk", requests=data["requests"], errors=data["errors"],
                      duration_s=round(data["duration_us"] / 1e6, 3), p50_ms=data["p50_us"] / 1000,
                      p99_ms=data["p99_us"] / 1000, first_error="see wrk" if data["errors"] else "")


def py_spy_path() -> str | None:
    """py-spy next to this interpreter (a venv install) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclasses.dataclass(frozen=True)
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
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = stack.split(";")
            own[frames[-1]] += int(count)
            caller[_deepest_kvgate_frame(frames)] += int(count)
    total = own.total()

    def shares(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(n / total, 3)) for frame, n in counter.most_common(top)] if total else []

    return Profile(samples=total, top_self=shares(own), top_kvgate=shares(caller))


def _least_disturbed(runs: list[LoadResult]) -> LoadResult:
    """The run with the lowest median latency, preferring runs without errors: other work on a shared machine only
    ever slows a run down, so the best of a few is the closest to the undisturbed number."""
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


@dataclasses.dataclass
class Rig:
    """The running stubs and kvgate, and the measurements taken on them."""

    stub: ChildProcess
    kvgate: ChildProcess
    replica_urls: list[str]
    gateway_url: str
    gateway_cpu: int | None
    other_cpu: int | None

    def pinning(self) -> str:
        """How processes share the CPUs, in words."""
        if self.gateway_cpu is None:
            return "not pinned (fewer than two usable CPUs)"
        return f"kvgate on CPU {self.gateway_cpu}; stub replicas, load generator and py-spy on CPU {self.other_cpu}"

    def _charged(self, run: Callable[[], LoadResult]) -> tuple[LoadResult, float, dict[str, float]]:
        """What `run` returns, its wall time, and the CPU seconds kvgate, the stub and the load generators used."""
        def cpu() -> dict[str, float]:
            return {"kvgate": self.kvgate.cpu_seconds(), "stub": self.stub.cpu_seconds(),
                    "client": _children_cpu_seconds()}

        before, started = cpu(), time.perf_counter()
        result = run()
        wall, after = time.perf_counter() - started, cpu()
        return result, wall, {name: after[name] - before[name] for name in before}

    def _wrk(self, spec: LoadSpec) -> LoadResult:
        """A warm-up wrk run, then the measured one with each process's CPU charged over it."""
        if spec.warmup_s:
            run_wrk(dataclasses.replace(spec, duration_s=spec.warmup_s), self.other_cpu)
        result, wall, used = self._charged(lambda: run_wrk(spec, self.other_cpu))
        return dataclasses.replace(result, busy={name: round(seconds / wall, 3) for name, seconds in used.items()})

    def _python(self, spec: LoadSpec) -> LoadResult:
        """The Python generator in its own process; it charges CPU over its own measured stretch."""
        assert self.kvgate.pid is not None and self.stub.pid is not None, "the rig is stopped"
        spec = dataclasses.replace(spec, watch=(("kvgate", self.kvgate.pid), ("stub", self.stub.pid)))
        command = pinned([sys.executable, "-m", "kvgate.loadtest.overhead.client",
                          orjson.dumps(spec.to_json()).decode()], self.other_cpu)
        done = subprocess.run(command, capture_output=True, text=True, check=True,
                              timeout=spec.warmup_s + spec.duration_s + 120)
        result = orjson.loads(done.stdout.splitlines()[-1])
        return LoadResult(**{f.name: result[f.name] for f in dataclasses.fields(LoadResult)})

    def measure(self, spec: LoadSpec, generator: str) -> LoadResult:
        """Run one load with `generator` ("wrk" or "python")."""
        return self._wrk(spec) if generator == "wrk" else self._python(spec)

    def compare(self, name: str, spec: LoadSpec, generator: str, repeats: int = 1) -> dict[str, Any]:
        """The load sent to the first replica, then through kvgate, `repeats` times in turn; each side's least
        disturbed run, kvgate's throughput against the direct one, the latency it adds, and what bound the run."""
        direct, through = [], []
        for _ in range(repeats):
            direct.append(self.measure(dataclasses.replace(spec, url=self.replica_urls[0]), generator))
            through.append(self.measure(dataclasses.replace(spec, url=self.gateway_url), generator))
        alone, kvgate = _least_disturbed(direct), _least_disturbed(through)
        busy = kvgate.busy
        if busy.get("kvgate", 0.0) >= BUSY:
            bound = "kvgate CPU"  # its own core
        elif busy.get("client", 0.0) + busy.get("stub", 0.0) >= BUSY:
            bound = "client+stub CPU"  # the core the load generator and the stub share
        else:
            bound = "not CPU"
        return {"name": name, "spec": spec.to_json(), "direct": alone.to_json(), "kvgate": kvgate.to_json(),
                "rps_ratio": round(kvgate.rps / alone.rps if alone.rps else 0.0, 3),
                "added_p50_ms": round(kvgate.p50_ms - alone.p50_ms, 3),
                "added_p99_ms": round(kvgate.p99_ms - alone.p99_ms, 3), "bound": bound}

    def stream_cpu(self, spec: LoadSpec) -> dict[str, Any]:
        """CPU that kvgate and the stub spent relaying the same streamed chunks (no warm-up: every chunk counts)."""
        spec = dataclasses.replace(spec, url=self.gateway_url, stream=True, warmup_s=0.0)
        result, wall, used = self._charged(lambda: self._python(spec))
        chunks, kvgate_s, stub_s = result.requests * spec.chunks, round(used["kvgate"], 3), round(used["stub"], 3)
        return {"chunks": chunks, "wall_s": round(wall, 3), "kvgate_cpu_s": kvgate_s, "stub_cpu_s": stub_s,
                "errors": result.errors,
                "kvgate_cpu_s_per_10k_chunks": round(kvgate_s / chunks * 10_000 if chunks else 0.0, 4),
                "stub_cpu_s_per_10k_chunks": round(stub_s / chunks * 10_000 if chunks else 0.0, 4),
                "kvgate_over_stub": round(kvgate_s / stub_s, 2) if stub_s else None}

    def profile(self, spec: LoadSpec, py_spy: str, output: Path, generator: str) -> Profile | None:
        """kvgate's py-spy profile while the spec's load runs through it; None when py-spy could not sample (ptrace)."""
        spec = dataclasses.replace(spec, url=self.gateway_url, warmup_s=0.0)
        assert self.kvgate.pid is not None, "the rig is stopped"
        command = [py_spy, "record", "--pid", str(self.kvgate.pid), "--duration", str(max(1, round(spec.duration_s))),
                   "--format", "raw", "--nolineno", "--rate", "200", "--output", str(output)]
        recorder = subprocess.Popen(pinned(command, self.other_cpu), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.measure(spec, generator)
        _, stderr = recorder.communicate(timeout=120)
        if recorder.returncode != 0 or not output.exists():
            print(f"py-spy failed: {stderr.decode(errors='replace')[-300:]}", file=sys.stderr)
            return None
        return summarize(output.read_text())
