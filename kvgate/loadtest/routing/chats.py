"""`kvgate bench chats`: Poisson multi-turn chats of tenants sharing system prompts, uniform and Zipf popularity;
every row replays the same conversations, a turn sent once the last answer came back; --peer holds kvgate to another."""

from __future__ import annotations

import argparse
import dataclasses

from kvgate.loadtest.routing.client import ChatLoad
from kvgate.loadtest.routing.scenario import (
    add_precise_argument,
    add_router_arguments,
    add_workload_arguments,
    precise_tokenizer,
    run_loads,
    workload,
)
from kvgate.loadtest.routing.workload import CHAT_UNIFORM, CHAT_ZIPF, QUICK_CHATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The chat scenarios' flags (workload knobs apply to both; chat-zipf keeps its own rate and concurrency)."""
    add_router_arguments(parser, policies=("cache-aware",))
    parser.add_argument("--skew", choices=("uniform", "zipf", "both"), default="both", help="tenant popularity")
    add_precise_argument(parser)
    add_workload_arguments(parser, CHAT_UNIFORM)


def run(options: argparse.Namespace) -> int:
    """Measure every row on chat-uniform and/or chat-zipf."""
    uniform = QUICK_CHATS if options.quick else CHAT_UNIFORM
    zipf = dataclasses.replace(QUICK_CHATS, skew="zipf") if options.quick else CHAT_ZIPF
    presets = {"uniform": uniform, "zipf": zipf}
    skews = ("uniform", "zipf") if options.skew == "both" else (options.skew,)
    loads = tuple(ChatLoad(f"chat-{skew}", workload(options, presets[skew])) for skew in skews)
    return run_loads(options, loads, "Multi-turn chats, Poisson arrivals", "chats",
                     tokenizer_dir=precise_tokenizer(options))
