"""Sampling kvgate under load with py-spy and naming where its CPU goes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvgate.loadtest.kit.processes import pinned

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
