"""Simulator settings sized from a load's footprint: a fleet whose caches hold part of the prefixes, and the oracles."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvgate.loadtest.routing.workload import CHARS_PER_TOKEN, PrefixFootprint, WorkloadSpec
from kvgate.simulator import SimOptions


@dataclass(frozen=True, slots=True)
class Footprint:
    """KV cache a load's prefixes take, in blocks of the fleet's block size."""

    in_play_blocks: int  # distinct prefixes live at once: what a replica holding `cache_fraction` of is sized by
    whole_blocks: int  # every prefix the load ever sends: the oracle never evicts
    longest_request_tokens: int  # prompt plus output of the longest request
    open_requests: int  # requests the load keeps open at once, about

    @classmethod
    def of_chats(cls, spec: WorkloadSpec, block_size: int, chars_per_token: float = CHARS_PER_TOKEN) -> Footprint:
        """Every tenant's system prompt and every open conversation are in play at once."""
        prefix = PrefixFootprint.of(spec, block_size, chars_per_token)
        return cls(prefix.all_system_prompts(spec) + spec.concurrency * prefix.history_blocks,
                   prefix.whole_workload(spec), prefix.longest_request_tokens, spec.concurrency)


def _model_len(footprint: Footprint, block_size: int) -> int:
    """A context length that fits the longest request, in whole blocks."""
    return math.ceil(footprint.longest_request_tokens / block_size) * block_size


def fleet_options(footprint: Footprint, model: str, base: SimOptions, cache_fraction: float) -> SimOptions:
    """Replica settings whose KV cache holds `cache_fraction` of the distinct prefixes in play.

    At one half, a router that keeps each tenant and conversation on one of three replicas finds its
    prefixes cached, while one that spreads every tenant everywhere keeps evicting them.
    """
    model_len = _model_len(footprint, base.block_size)
    blocks = max(math.ceil(cache_fraction * footprint.in_play_blocks), model_len // base.block_size)
    return dataclasses.replace(base, models=(model,), num_gpu_blocks=blocks, max_model_len=model_len,
                               max_num_seqs=max(base.max_num_seqs, footprint.open_requests))


def oracle_options(footprint: Footprint, model: str, base: SimOptions) -> SimOptions:
    """One replica that never evicts a prefix and never queues for a seat: the hit-rate ceiling."""
    return dataclasses.replace(
        base,
        models=(model,),
        num_gpu_blocks=2 * footprint.whole_blocks,  # twice the bound: nothing is ever evicted
        max_model_len=_model_len(footprint, base.block_size),
        max_num_seqs=2 * footprint.open_requests,
    )


def pressure_oracle_options(fleet: SimOptions, replicas: int) -> SimOptions:
    """One replica whose cache and seats equal the whole fleet's: what routing under pressure could at best hit."""
    return dataclasses.replace(fleet, num_gpu_blocks=replicas * fleet.num_gpu_blocks, kv_events=False,
                               max_num_seqs=replicas * fleet.max_num_seqs)
