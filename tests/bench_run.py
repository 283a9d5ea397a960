"""Running `kvgate bench` as a command in a session of its own, and checking it left no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_CLEANUP_SECONDS = 60  # after SIGINT, for the benchmark to stop what it started


def _leftovers(session: int, out: str | None) -> list[str]:
    """Command lines of live processes in `session`, or naming `out` (vLLM engines run in sessions of their own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_text().replace("\0", " ")
        except (OSError, IndexError):
            continue  # the process ended while being read
        if fields[0] != "Z" and (int(fields[3]) == session or (out is not None and out in cmdline)):
            found.append(cmdline)
    return found


def run_bench(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    """`kvgate bench ARGS` to its end; fails the test if any process it started outlives it.

    A run past `timeout` gets SIGINT, so that it stops its children as on Ctrl-C, and then the test fails.
    """
    process = subprocess.Popen([sys.executable, "-m", "kvgate.router.cli", "bench", *args], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=_CLEANUP_SECONDS)
        finally:
            os.killpg(process.pid, signal.SIGKILL)
        raise
    out = args[args.index("--out") + 1] if "--out" in args else None
    leftovers = _leftovers(process.pid, out)
    assert not leftovers, f"kvgate bench {' '.join(args)} left processes running: {leftovers}"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
