"""Child processes of a benchmark: simulated fleets, kvgate gateways and external routers on loopback ports."""

from __future__ import annotations

import asyncio
import logging
import shlex
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from kvgate.loadtest.bench.sizing import sim_flags
from kvgate.simulator import SimOptions

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_KVGATE = [sys.executable, "-m", "kvgate.router.cli"]
_READY_TIMEOUT_SECONDS = 60.0
_STOP_TIMEOUT_SECONDS = 10.0
_POLL_SECONDS = 0.1
_LOG_TAIL_CHARS = 2000


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


def base_url(port: int) -> str:
    """The loopback base URL of a port."""
    return f"http://{HOST}:{port}"


class ChildProcess:
    """A started command whose output goes to a log file, ready once an HTTP path answers 200."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        """The running child's process id."""
        return self._process.pid if self._process is not None and self._process.returncode is None else None

    async def start(self) -> None:
        """Launch the command."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log_file:
            try:
                self._process = await asyncio.create_subprocess_exec(
                    *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT
                )
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

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if the child outlives the grace period."""
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), _STOP_TIMEOUT_SECONDS)
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


async def start_sim_fleet(name: str, replicas: int, options: SimOptions, log_dir: Path) -> tuple[ChildProcess, list[str]]:
    """`kvgate sim` serving `replicas` replicas; returns the process and the replica base URLs once healthy."""
    ports = free_ports(replicas)
    argv = [*_KVGATE, "sim", "--ports", ",".join(map(str, ports)), "--host", HOST, *sim_flags(options)]
    child = ChildProcess(name, argv, log_dir / f"{name}.log")
    urls = [base_url(port) for port in ports]
    await _start_ready(child, [url + "/health" for url in urls])
    return child, urls


async def start_gateway(name: str, policy: str, endpoints: Sequence[str], log_dir: Path,
                        extra: Sequence[str] = ()) -> tuple[ChildProcess, str]:
    """`kvgate serve` with one policy in front of `endpoints` (and `extra` flags); the process and its URL once ready."""
    (port,) = free_ports(1)
    argv = [
        *_KVGATE, "serve", "--listen", f"{HOST}:{port}", "--endpoints", ",".join(endpoints), "--policy", policy,
        "--drain-delay", "0", "--drain-timeout", "2", "--log-level", "warning", *extra,
    ]  # fmt: skip
    child = ChildProcess(name, argv, log_dir / f"{name}.log")
    url = base_url(port)
    await _start_ready(child, [url + "/readyz"])
    return child, url


def precise_args(endpoints: Sequence[str], options: SimOptions, tokenizer_dir: Path) -> list[str]:
    """`kvgate serve` flags that subscribe to each simulated replica's KV events and tokenize as it does."""
    args = []
    for url in endpoints:
        port = int(url.rpartition(":")[2])
        offset = options.kv_events_port_offset
        args += ["--kv-events-endpoint", f"{url}=tcp://{HOST}:{port + offset}",
                 "--kv-events-replay-endpoint", f"{url}=tcp://{HOST}:{port + 2 * offset}"]
    return [*args, "--tokenizer", f"{options.models[0]}={tokenizer_dir}"]


def external_argv(template: str, workers: Sequence[str], port: int) -> list[str]:
    """An external router's command line: `{workers}` becomes space-separated URLs, `{port}` its port."""
    return shlex.split(template.format(workers=" ".join(workers), port=port))


async def start_external(name: str, template: str, workers: Sequence[str], log_dir: Path) -> tuple[ChildProcess, str]:
    """An external router from a command line template; ready once `GET /v1/models` answers 200."""
    (port,) = free_ports(1)
    child = ChildProcess(name, external_argv(template, workers, port), log_dir / f"{name}.log")
    url = base_url(port)
    await _start_ready(child, [url + "/v1/models"])
    return child, url


async def _start_ready(child: ChildProcess, ready_urls: Sequence[str]) -> None:
    try:
        await child.start()
        await child.wait_ready(ready_urls)
    except BaseException:
        await child.stop()
        raise
