"""The soak's child processes: kvgate, and one `kvgate sim` process per replica so one can be killed alone."""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate.loadtest.bench.processes import HOST, ChildProcess, base_url, free_ports
from kvgate.loadtest.bench.sizing import sim_flags
from kvgate.simulator import SimOptions

_KVGATE = [sys.executable, "-m", "kvgate.router.cli"]


class KillableProcess(ChildProcess):
    """A child process whose pid is known (to sample it) and that can be killed without warning."""

    @property
    def pid(self) -> int:
        """The running child's process id."""
        assert self._process is not None, "not started"
        return self._process.pid

    async def kill(self) -> None:
        """SIGKILL, as the OOM killer or a node failure would, and reap it."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGKILL)
            await process.wait()


class SimReplicaProcess:
    """One simulated replica in its own process on a fixed port, so a restart comes back at the same URL."""

    def __init__(self, name: str, options: SimOptions, log_dir: Path) -> None:
        (self.port,) = free_ports(1)
        self.url = base_url(self.port)
        self._argv = [*_KVGATE, "sim", "--ports", str(self.port), "--host", HOST, *sim_flags(options)]
        self._name = name
        self._log_dir = log_dir
        self._starts = 0
        self._child: KillableProcess | None = None

    async def start(self) -> None:
        """Start (or restart) the replica and wait until /health answers."""
        self._starts += 1
        child = KillableProcess(self._name, self._argv, self._log_dir / f"{self._name}-{self._starts}.log")
        await child.start()
        try:
            await child.wait_ready([self.url + "/health"])
        except BaseException:
            await child.stop()
            raise
        self._child = child

    async def kill(self) -> None:
        """Kill the replica's process with SIGKILL."""
        child, self._child = self._child, None
        if child is not None:
            await child.kill()

    async def stop(self) -> None:
        """Stop the replica gracefully, if it runs."""
        child, self._child = self._child, None
        if child is not None:
            await child.stop()


async def start_kvgate(endpoints: Sequence[str], flags: Sequence[str], log_dir: Path) -> tuple[KillableProcess, str]:
    """`kvgate serve` in front of `endpoints`; returns the process and its URL once /readyz answers."""
    (port,) = free_ports(1)
    argv = [*_KVGATE, "serve", "--listen", f"{HOST}:{port}", "--endpoints", ",".join(endpoints),
            "--drain-delay", "0", "--drain-timeout", "2", "--log-level", "warning", *flags]
    child = KillableProcess("kvgate", argv, log_dir / "kvgate.log")
    url = base_url(port)
    await child.start()
    try:
        await child.wait_ready([url + "/readyz"])
    except BaseException:
        await child.stop()
        raise
    return child, url
