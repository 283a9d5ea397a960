"""Real vLLM engines (the CPU build) as the routing benchmark's fleet and oracle, sized in their own blocks and
tokens, probed through their own counters (`vllm:prefix_cache_hits_total` / `queries_total`)."""

from __future__ import annotations

import math
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from kvgate.loadtest.kit.counters import RunningFleet
from kvgate.loadtest.kit.processes import free_ports
from kvgate.loadtest.kit.tiny_model import write_tiny_model
from kvgate.loadtest.kit.vllm_engine import EngineSpec, running_engines
from kvgate.loadtest.routing.workload import Footprint, WorkloadSpec, system_prompt, user_message

BLOCK_SIZE = 128  # vLLM's block size on CPU
KV_BYTES_PER_TOKEN = 1024  # the tiny model: 2 layers x (K, V) x 4 heads x 32 dims x 2 bytes

def measured_chars_per_token(model_dir: Path, spec: WorkloadSpec) -> float:
    """Characters per token of the workload's own text under the model's tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = system_prompt(0, spec.system_prompt_chars) + user_message(0, 0, spec.user_chars, spec.seed)
    return len(text) / len(tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True, slots=True)
class EngineSizing:
    """KV blocks, context length and seats of the fleet's engines and of the oracle."""

    fleet_blocks: int
    oracle_blocks: int
    max_model_len: int
    fleet_seats: int
    oracle_seats: int
    chars_per_token: float

    @classmethod
    def of(cls, spec: WorkloadSpec, cache_fraction: float, chars_per_token: float) -> EngineSizing:
        """Each fleet engine holds `cache_fraction` of the prefixes in play; the oracle twice the whole workload."""
        footprint = Footprint.of_chats(spec, BLOCK_SIZE, chars_per_token)
        model_len = footprint.model_len(BLOCK_SIZE)
        return cls(fleet_blocks=max(math.ceil(cache_fraction * footprint.in_play_blocks), 2 * model_len // BLOCK_SIZE),
                   oracle_blocks=2 * footprint.whole_blocks, max_model_len=model_len,
                   fleet_seats=max(8, spec.concurrency), oracle_seats=2 * spec.concurrency,
                   chars_per_token=chars_per_token)


def engine_sizing(spec: WorkloadSpec, cache_fraction: float, workdir: Path) -> EngineSizing:
    """The engines' sizing for a workload, measured with the tiny model's tokenizer (written under `workdir`)."""
    return EngineSizing.of(spec, cache_fraction, measured_chars_per_token(write_tiny_model(workdir / "model"), spec))


@asynccontextmanager
async def vllm_fleet(spec: WorkloadSpec, replicas: int, cache_fraction: float, python: str, workdir: Path,
                     precise: bool = False) -> AsyncIterator[RunningFleet]:
    """Start `replicas` fleet engines (one per core, round robin) and the oracle; with `precise` the fleet publishes
    KV events and one more engine with the whole fleet's cache is the pressure oracle.

    The engines publish on ipc:// sockets, which vLLM binds, so any number of gateways connect to them. (A tcp://
    address without `*` would make vLLM connect out to a gateway that binds it: one gateway only, and a port picked
    free at the start may be some connection's source port by the time the gateway binds it.)"""
    sizing = engine_sizing(spec, cache_fraction, workdir)
    model_dir = workdir / "model"
    ports = free_ports(replicas + 2)
    # A short folder of its own: a socket's path must fit in 107 characters, whatever `workdir` is.
    with tempfile.TemporaryDirectory(prefix="kvgate-events-") as sockets:

        def engine(port: int, cpu: int, blocks: int, seats: int, publish: bool = False) -> EngineSpec:
            return EngineSpec(port=port, cpu=cpu, model_dir=model_dir, served_model_name=spec.model,
                              kv_cache_bytes=blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN, max_num_seqs=seats,
                              max_model_len=sizing.max_model_len, prompt_tokens_details=True,
                              kv_events_endpoint=f"ipc://{sockets}/{port}" if publish else None,
                              kv_events_replay_endpoint=f"ipc://{sockets}/{port}.replay" if publish else None)

        specs = [engine(port, index % 2, sizing.fleet_blocks, sizing.fleet_seats, precise)
                 for index, port in enumerate(ports[:replicas])]
        specs.append(engine(ports[replicas], 0, sizing.oracle_blocks, sizing.oracle_seats))
        if precise:
            specs.append(engine(ports[replicas + 1], 1, replicas * sizing.fleet_blocks, replicas * sizing.fleet_seats))
        async with running_engines(specs, workdir / "engines", python) as engines:
            fleet = engines[:replicas]
            flags = [flag for e in fleet for flag in ("--kv-events-endpoint", f"{e.url}={e.kv_events_endpoint}",
                                                      "--kv-events-replay-endpoint", f"{e.url}={e.replay_endpoint}")]
            direct = {"oracle": [engines[replicas].url]} | ({"pressure oracle": [engines[-1].url]} if precise else {})
            flags += ["--tokenizer", f"{spec.model}={model_dir}"]
            yield RunningFleet([e.url for e in fleet], direct, flags)
