"""Real vLLM OpenAI servers (the CPU build, from $KVGATE_VLLM_PYTHON: `./dev real` sets it) on loopback: each its own
process group pinned to one core, every file it writes under the caller's directory. (No parent-death signal: Linux
ties it to the starting thread, and engines restarted from a worker thread would die with that thread.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.loadtest.kit.report import BadOption

VLLM_PYTHON_ENV = "KVGATE_VLLM_PYTHON"
HASH_SEED = "0"  # PYTHONHASHSEED of every engine: sha256_cbor block hashes are then the same on every run


def vllm_python() -> str | None:
    """The interpreter with vLLM installed, or None when the real-engine suite was not set up. A relative path is
    taken from the current directory and made absolute (engines run in their own directories); its symlink is
    kept, since a virtual environment's interpreter is one."""
    path = os.environ.get(VLLM_PYTHON_ENV)
    return str(Path(path).absolute()) if path and Path(path).exists() else None


def require_vllm_python(flag: str = "") -> str:
    """vllm_python(), or BadOption saying that the scenario (or its `flag`) needs it."""
    python = vllm_python()
    if python is None:
        raise BadOption(f"{flag + ' ' if flag else ''}needs {VLLM_PYTHON_ENV}, an interpreter with vLLM (./dev real makes one)")
    return python


@dataclass(frozen=True)
class EngineSpec:
    """How one engine is started."""

    port: int
    cpu: int  # the core its worker threads are pinned to
    model_dir: Path
    served_model_name: str = "tiny-llama"
    kv_cache_bytes: int = 48 * 128 * 1024  # 48 blocks of 128 tokens: the tiny model takes 1 KiB per token
    max_num_seqs: int = 8
    max_model_len: int = 4096
    priority_scheduling: bool = False
    # Where KV events are published (vLLM binds ipc:// and tcp://*: addresses, connects out to others); None: none.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None  # always bound by the engine
    shutdown_timeout: int = 10  # seconds in-flight requests get after SIGTERM
    prompt_tokens_details: bool = False  # each answer's usage tells its cached prompt tokens

    def argv(self, python: str) -> list[str]:
        """The command line of this engine."""
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager",
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--enable-prefix-caching", "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                "--prefix-caching-hash-algo", "sha256_cbor", "--shutdown-timeout", str(self.shutdown_timeout),
                "--disable-uvicorn-access-log"]  # fmt: skip
        if self.priority_scheduling:
            argv += ["--scheduling-policy", "priority"]
        if self.prompt_tokens_details:
            argv += ["--enable-prompt-tokens-details"]
        if self.kv_events_endpoint is not None:
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                      "endpoint": self.kv_events_endpoint}
            if self.kv_events_replay_endpoint is not None:
                events["replay_endpoint"] = self.kv_events_replay_endpoint
            argv += ["--kv-events-config", json.dumps(events)]
        return argv


@dataclass
class VllmEngine:
    """One running (or stopped) vLLM server."""

    spec: EngineSpec
    workdir: Path  # everything the engine writes goes below it
    python: str
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """Base URL of its OpenAI server."""
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where its KV events are published, if enabled."""
        return self.spec.kv_events_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """Where buffered KV event batches can be replayed from, if enabled."""
        return self.spec.kv_events_replay_endpoint

    @property
    def log_path(self) -> Path:
        """The engine's combined stdout and stderr."""
        return self.workdir / "engine.log"

    def start(self) -> None:
        """Start the process; returns at once (see `wait_ready`)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(self.spec.cpu), "TMPDIR": str(tmp),
               "VLLM_CACHE_ROOT": str(self.workdir / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(self.workdir / "inductor"),
               "HF_HUB_OFFLINE": "1", "HF_HOME": str(self.workdir / "hf"), "PYTHONHASHSEED": HASH_SEED,
               "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.spec.argv(self.python), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until `/health` answers 200; raises with the log's tail if the engine dies or is late."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"vLLM engine on port {self.spec.port} exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM engine on port {self.spec.port} not healthy after {timeout} s:\n{self.log_tail()}")

    def signal(self, signum: int, group: bool = True) -> None:
        """Send a signal to the engine's whole process group, or (group=False) to its API server alone.

        The kubelet signals a container's main process only: that is how vLLM's graceful shutdown begins.
        """
        if self.process is not None and self.process.poll() is None:
            (os.killpg if group else os.kill)(self.process.pid, signum)

    def kill_group(self) -> None:
        """SIGKILL every process of the engine's group, those its API server left behind when it exited included."""
        if self.process is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(grace)
        self.kill_group()
        self.process.wait(5)
        self.process = None

    def restart(self, timeout: float = 180.0) -> None:
        """Stop and start again on the same ports: its prefix cache starts empty."""
        self.stop()
        self.start()
        self.wait_ready(timeout)

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache (needs VLLM_SERVER_DEV_MODE, which `start` sets)."""
        request = urllib.request.Request(self.url + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def log_tail(self, lines: int = 40) -> str:
        """The log's first error (`lines` lines from its first ERROR or traceback line: an engine core that fails
        to start says why there, long before the API server's own traceback ends the log) and its last lines."""
        if not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        first = next((number for number, line in enumerate(text) if "ERROR" in line or line.startswith("Traceback")),
                     None)
        if first is None:
            return "\n".join(text[-lines:])
        tail_from = max(first + lines, len(text) - lines)
        return "\n".join([*text[first:first + lines], *(["..."] if tail_from > first + lines else []),
                          *text[tail_from:]])


def start_engines(specs: list[EngineSpec], workdir: Path, python: str, timeout: float = 240.0) -> list[VllmEngine]:
    """Start every engine at once and wait until all are healthy; stops them all if one fails."""
    engines = [VllmEngine(spec, workdir / f"engine-{spec.port}", python) for spec in specs]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready(timeout)
    except BaseException:
        for engine in engines:
            engine.stop(grace=5)
        raise
    return engines


@asynccontextmanager
async def running_engines(specs: list[EngineSpec], workdir: Path, python: str) -> AsyncIterator[list[VllmEngine]]:
    """start_engines off the event loop; every engine stopped when the block exits, however it exits."""
    engines = await asyncio.to_thread(start_engines, specs, workdir, python)
    try:
        yield engines
    finally:
        await asyncio.gather(*(asyncio.to_thread(engine.stop) for engine in engines))
