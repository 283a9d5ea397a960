"""Child processes of the benchmark: started pinned to a CPU, probed for readiness, charged for CPU time."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_layout() -> tuple[int | None, int | None]:
    """(CPU for kvgate, CPU for everything else), or (None, None) when fewer than two CPUs are usable."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[1], cpus[0]) if len(cpus) >= 2 else (None, None)


def pinned(command: Sequence[str], cpu: int | None) -> list[str]:
    """`command` run under taskset on `cpu`, or unchanged when not pinning."""
    return ["taskset", "-c", str(cpu), *command] if cpu is not None else list(command)


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds `pid` has used so far (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14 and 15 of the line


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished, waited-for children (the load generators)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Service:
    """A long-running child (stub fleet, kvgate) whose stderr goes to a temporary log file."""

    def __init__(self, name: str, command: Sequence[str], cpu: int | None) -> None:
        self.name = name
        self._log = tempfile.TemporaryFile(prefix=f"kvgate-bench-{name}-")
        self.process = subprocess.Popen(pinned(command, cpu), stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        """The process id (taskset execs the command, so it is the command's own)."""
        return self.process.pid

    def cpu_seconds(self) -> float:
        """CPU seconds used so far."""
        return process_cpu_seconds(self.pid)

    def wait_ready(self, url: str, timeout_s: float = 20.0) -> None:
        """Poll `url` until it answers 200; raise with the log tail when the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready at {url}: {self.log_tail()}")

    def log_tail(self, size: int = 2000) -> str:
        """The last bytes the process wrote."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-size:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
