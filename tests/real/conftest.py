"""Real vLLM engines (the CPU build) shared by the real-engine suite: `./dev real` sets it up and runs it.

Without `KVGATE_VLLM_PYTHON` (an interpreter with vLLM installed) every test here is skipped with that reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.loadtest.kit.processes import free_ports, ports_to_bind_later
from kvgate.loadtest.kit.tiny_model import write_tiny_model
from kvgate.loadtest.kit.vllm_engine import VLLM_PYTHON_ENV, EngineSpec, VllmEngine, start_engines, vllm_python

MODEL = "tiny-llama"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the real-engine tests where vLLM is not set up."""
    if vllm_python() is not None:
        return
    skip = pytest.mark.skip(reason=f"real-engine suite: needs {VLLM_PYTHON_ENV} (run ./dev real)")
    for item in items:
        if Path(item.fspath).is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny offline model directory every engine serves."""
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmEngine]]:
    """Two engines, one per core: 4 seats, 48 KV blocks of 128 tokens, priority scheduling, KV events with replay,
    cached prompt tokens in every answer's usage.

    Their events endpoints name an address (no `*`): vLLM connects out to it, and the gateway under test binds it."""
    python = vllm_python()
    assert python is not None
    ports, events = free_ports(4), ports_to_bind_later(2)
    specs = [EngineSpec(port=ports[i], cpu=i, model_dir=model_dir, served_model_name=MODEL, max_num_seqs=4,
                        priority_scheduling=True, prompt_tokens_details=True,
                        kv_events_endpoint=f"tcp://127.0.0.1:{events[i]}",
                        kv_events_replay_endpoint=f"tcp://127.0.0.1:{ports[2 + i]}") for i in range(2)]
    running = start_engines(specs, tmp_path_factory.mktemp("engines"), python)
    yield running
    for engine in running:
        engine.stop()


@pytest.fixture
def fresh_engines(engines: list[VllmEngine]) -> list[VllmEngine]:
    """The shared engines, restarted if a test stopped one, with empty prefix caches."""
    for engine in engines:
        if engine.process is None or engine.process.poll() is not None:
            engine.restart()
        engine.reset_prefix_cache()
    return engines
