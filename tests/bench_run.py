"""Running `kvgate bench` as a command in a session of its own, and checking it left no process behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _session_members(session: int) -> list[str]:
    """Command lines of the live processes in `session` (zombies, already dead, are left out)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[3]) == session and fields[0] != "Z":  # state, ppid, pgrp, session
                members.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return members


def run_bench(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    """`kvgate bench ARGS` to its end; fails the test if any process it started outlives it."""
    process = subprocess.Popen([sys.executable, "-m", "kvgate.router.cli", "bench", *args], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()
    leftovers = _session_members(process.pid)
    assert not leftovers, f"kvgate bench {' '.join(args)} left processes running: {leftovers}"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
