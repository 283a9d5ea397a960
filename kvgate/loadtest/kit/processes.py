"""Child processes of a benchmark on loopback ports (simulated fleets, gateways, stubs, other routers): each logs to
a file, is ready once an HTTP path answers 200, and is stopped (SIGTERM, then SIGKILL) by what started it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import shlex
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import aiohttp

from kvgate.simulator import SimOptions

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
KVGATE = [sys.executable, "-m", "kvgate.router.cli"]
_READY_TIMEOUT_SECONDS = 60.0
_STOP_TIMEOUT_SECONDS = 10.0
_POLL_SECONDS = 0.1
_LOG_TAIL_CHARS = 2000
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_Found = TypeVar("_Found")


class ProcessError(RuntimeError):
    """A child process failed to start or become ready; the message carries its log's tail."""


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free on loopback now (held open together so they differ)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def ports_to_bind_later(count: int) -> list[int]:
    """Ports free on loopback now and below the kernel's ephemeral range, for an address one process binds while
    others connect to it first: an ephemeral port may meanwhile become a connection's source port (even the
    connecting socket's own, which then connects to itself), and the bind fails."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    ports: list[int] = []
    for port in random.sample(range(max(1024, low // 2), low), min(64 * count, low - max(1024, low // 2))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise OSError(f"no {count} free ports below {low}")


def base_url(port: int) -> str:
    """The loopback base URL of a port."""
    return f"http://{HOST}:{port}"


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


class ChildProcess:
    """A started command whose output goes to a log file, ready once an HTTP path answers 200."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, cpu: int | None = None,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = pinned(argv, cpu)  # taskset execs the command: the pid is the command's own
        self.log_path = log_path
        self._env, self._cwd = env, cwd
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        """The running child's process id."""
        return self._process.pid if self._process is not None and self._process.returncode is None else None

    def cpu_seconds(self) -> float:
        """CPU seconds the running child has used so far (0 once it has stopped)."""
        return 0.0 if self.pid is None else process_cpu_seconds(self.pid)

    async def start(self) -> None:
        """Launch the command."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log_file:
            try:
                self._process = await asyncio.create_subprocess_exec(
                    *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                    env=self._env, cwd=self._cwd)
            except OSError as exc:
                raise ProcessError(f"{self.name} could not start {self.argv[0]!r}: {exc.strerror}") from None
        log.debug("child started name=%s pid=%d argv=%s", self.name, self._process.pid, shlex.join(self.argv))

    async def wait_ready(self, urls: Sequence[str], timeout: float = _READY_TIMEOUT_SECONDS) -> None:
        """Poll every URL until each answers 200; ProcessError if the child exits or time runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending = list(urls)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while pending:
                if self._process is None or self._process.returncode is not None:
                    raise ProcessError(f"{self.name} exited before it was ready:\n{self.log_tail()}")
                if loop.time() > deadline:
                    raise ProcessError(f"{self.name} not ready within {timeout:.0f}s ({pending[0]}):\n{self.log_tail()}")
                try:
                    async with session.get(pending[0]) as response:
                        if response.status == 200:
                            pending.pop(0)
                            continue
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(_POLL_SECONDS)

    async def wait(self, timeout: float) -> int:
        """The child's exit status once it exits; TimeoutError after `timeout` seconds."""
        assert self._process is not None, f"{self.name} was not started"
        return await asyncio.wait_for(self._process.wait(), timeout)

    async def stop(self, kill: bool = False) -> None:
        """SIGTERM, then SIGKILL after the grace period; `kill`: SIGKILL at once (an OOM kill or a node failure)."""
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        if not kill:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), _STOP_TIMEOUT_SECONDS)
                return
            except TimeoutError:
                log.warning("child ignored SIGTERM name=%s pid=%d", self.name, process.pid)
        process.kill()
        await process.wait()

    def log_tail(self) -> str:
        """The end of the child's output, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


async def _started(name: str, argv: Sequence[str], urls: list[str], ready_path: str, log_dir: Path,
                   cpu: int | None = None) -> tuple[ChildProcess, list[str]]:
    """`argv` started and answering `ready_path` on every one of `urls`; a child that fails is stopped first."""
    child = ChildProcess(name, argv, log_dir / f"{name}.log", cpu)
    try:
        await child.start()
        await child.wait_ready([url + ready_path for url in urls])
    except BaseException:
        await child.stop()
        raise
    return child, urls


def sim_flags(options: SimOptions) -> list[str]:
    """`kvgate sim` flags that reproduce `options` (only the fields that differ from the defaults)."""
    defaults = SimOptions()
    flags: list[str] = []
    for knob in dataclasses.fields(SimOptions):
        value = getattr(options, knob.name)
        if value == getattr(defaults, knob.name):
            continue
        flag = "--" + knob.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + knob.name.replace("_", "-"))
        elif isinstance(value, tuple):
            flags += [flag, *value]
        else:
            flags += [flag, str(value)]
    return flags


async def start_sim_fleet(name: str, replicas: int, options: SimOptions, log_dir: Path,
                          ports: Sequence[int] = ()) -> tuple[ChildProcess, list[str]]:
    """`kvgate sim` serving `replicas` replicas (on `ports` if given); the process and the replica URLs once healthy."""
    ports = list(ports) or free_ports(replicas)
    argv = [*KVGATE, "sim", "--ports", ",".join(map(str, ports)), "--host", HOST, *sim_flags(options)]
    return await _started(name, argv, [base_url(port) for port in ports], "/health", log_dir)


async def start_gateway(name: str, endpoints: Sequence[str], flags: Sequence[str], log_dir: Path,
                        cpu: int | None = None) -> tuple[ChildProcess, str]:
    """`kvgate serve` in front of `endpoints` with `flags` (policy, ...); the process and its URL once ready."""
    (port,) = free_ports(1)
    argv = [*KVGATE, "serve", "--listen", f"{HOST}:{port}", "--endpoints", ",".join(endpoints), "--drain-delay", "0",
            "--drain-timeout", "2", "--log-level", "warning", *flags]
    child, (url,) = await _started(name, argv, [base_url(port)], "/readyz", log_dir, cpu)
    return child, url


def peer_flags(count: int, shared: bool) -> list[list[str]]:
    """`kvgate serve` flags for each of `count` gateways: with `shared`, those that make them share their routing
    decisions (router/peers.py), else none."""
    if not shared:
        return [[] for _ in range(count)]
    addresses = [f"{HOST}:{port}" for port in free_ports(count)]
    return [["--peer-listen", own, *(flag for peer in addresses if peer != own for flag in ("--peers", peer))]
            for own in addresses]


async def start_stub(name: str, replicas: int, log_dir: Path, cpu: int | None = None) -> tuple[ChildProcess, list[str]]:
    """Instant stub replicas (kit/stub.py) in one process; the process and the replica URLs once they answer."""
    ports = free_ports(replicas)
    argv = [sys.executable, "-m", "kvgate.loadtest.kit.stub", "--ports", ",".join(map(str, ports))]
    return await _started(name, argv, [base_url(port) for port in ports], "/v1/models", log_dir, cpu)


def external_argv(template: str, workers: Sequence[str], port: int) -> list[str]:
    """An external router's command line: `{workers}` becomes space-separated URLs, `{port}` its port."""
    return shlex.split(template.format(workers=" ".join(workers), port=port))


async def start_external(name: str, template: str, workers: Sequence[str], log_dir: Path) -> tuple[ChildProcess, str]:
    """An external router (nginx, SGLang's router, ...) from a command line template; ready once /v1/models answers."""
    (port,) = free_ports(1)
    child, (url,) = await _started(name, external_argv(template, workers, port), [base_url(port)], "/v1/models",
                                   log_dir)
    return child, url


@asynccontextmanager
async def running(started: Awaitable[tuple[ChildProcess, _Found]]) -> AsyncIterator[_Found]:
    """What a `start_*` call found (its URL or URLs), its child stopped when the block exits, however it exits."""
    child, found = await started
    async with stopping(child):
        yield found


@asynccontextmanager
async def stopping(child: ChildProcess) -> AsyncIterator[ChildProcess]:
    """Stop `child` when the block exits, however it exits."""
    try:
        yield child
    finally:
        await child.stop()
