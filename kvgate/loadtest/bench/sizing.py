"""Simulator settings sized from a workload: a fleet whose caches hold part of the prefixes, and the oracle."""

from __future__ import annotations

import dataclasses
import math

from kvgate.loadtest.bench.workload import CHARS_PER_TOKEN, PrefixFootprint, WorkloadSpec
from kvgate.simulator import SimOptions


def _model_len(footprint: PrefixFootprint, block_size: int) -> int:
    """A context length that fits the longest request, in whole blocks."""
    return math.ceil(footprint.longest_request_tokens / block_size) * block_size


def prefixes_in_play(spec: WorkloadSpec, block_size: int, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """Blocks of the distinct prefixes live at once: every tenant's system prompt and every open conversation."""
    footprint = PrefixFootprint.of(spec, block_size, chars_per_token)
    return footprint.all_system_prompts(spec) + spec.concurrency * footprint.history_blocks


def fleet_options(spec: WorkloadSpec, base: SimOptions, cache_fraction: float,
                  chars_per_token: float = CHARS_PER_TOKEN) -> SimOptions:
    """Replica settings whose KV cache holds `cache_fraction` of the distinct prefixes in play.

    At one half, a router that keeps each tenant and conversation on one of three replicas finds its
    prefixes cached, while one that spreads every tenant everywhere keeps evicting them.
    """
    footprint = PrefixFootprint.of(spec, base.block_size, chars_per_token)
    model_len = _model_len(footprint, base.block_size)
    in_play = prefixes_in_play(spec, base.block_size, chars_per_token)
    blocks = max(math.ceil(cache_fraction * in_play), model_len // base.block_size)
    return dataclasses.replace(
        base,
        models=(spec.model,),
        num_gpu_blocks=blocks,
        max_model_len=model_len,
        max_num_seqs=max(base.max_num_seqs, spec.concurrency),
    )


def oracle_options(spec: WorkloadSpec, base: SimOptions, chars_per_token: float = CHARS_PER_TOKEN) -> SimOptions:
    """One replica that never evicts a prefix and never queues for a seat: the hit-rate ceiling."""
    footprint = PrefixFootprint.of(spec, base.block_size, chars_per_token)
    return dataclasses.replace(
        base,
        models=(spec.model,),
        num_gpu_blocks=2 * footprint.whole_workload(spec),  # twice the bound: nothing is ever evicted
        max_model_len=_model_len(footprint, base.block_size),
        max_num_seqs=2 * spec.concurrency,
    )


def pressure_oracle_options(fleet: SimOptions, replicas: int) -> SimOptions:
    """One replica whose cache and seats equal the whole fleet's: what routing under pressure could at best hit."""
    return dataclasses.replace(fleet, num_gpu_blocks=replicas * fleet.num_gpu_blocks, kv_events=False,
                               max_num_seqs=replicas * fleet.max_num_seqs)


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
