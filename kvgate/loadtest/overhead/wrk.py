"""Closed-loop load with wrk (C, one thread), which leaves far more CPU to the processes under test."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvgate.loadtest.kit.processes import pinned
from kvgate.loadtest.kit.stream import CHAT_PATH
from kvgate.loadtest.overhead.bodies import chat_bodies
from kvgate.loadtest.overhead.load import LoadResult, LoadSpec

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
