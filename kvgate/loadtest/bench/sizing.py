"""Simulator settings sized from a scenario: a fleet whose caches hold part of the prefixes, and the oracle."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvgate.simulator import SimOptions


@dataclass(frozen=True, slots=True)
class Footprint:
    """KV cache a scenario's prefixes take, in blocks of the fleet's block size."""

    in_play_blocks: int  # distinct prefixes live at once: what a replica holding `cache_fraction` of is sized by
    whole_blocks: int  # every prefix the scenario ever sends: the oracle never evicts
    longest_request_tokens: int  # prompt plus output of the longest request
    open_requests: int  # requests the load keeps open at once, about


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
    return dataclasses.replace(
        base,
        models=(model,),
        num_gpu_blocks=blocks,
        max_model_len=model_len,
        max_num_seqs=max(base.max_num_seqs, footprint.open_requests),
    )


def oracle_options(footprint: Footprint, model: str, base: SimOptions) -> SimOptions:
    """One replica that never evicts a prefix and never queues for a seat: the hit-rate ceiling."""
    model_len = _model_len(footprint, base.block_size)
    return dataclasses.replace(
        base,
        models=(model,),
        num_gpu_blocks=max(2 * footprint.whole_blocks, model_len // base.block_size),  # twice: nothing is evicted
        max_model_len=model_len,
        max_num_seqs=max(base.max_num_seqs, 4 * footprint.open_requests),
    )


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
