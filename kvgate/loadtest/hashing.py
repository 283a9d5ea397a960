"""`kvgate bench hashing`: cost of building RequestInfo (prefix hashing, and for precise routing the engine's
tokenization) next to parsing the same body, and of one pick on the approximate and on the precise index."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from kvgate.endpoints.types import Endpoint, EndpointState, FleetSnapshot
from kvgate.engine.kv_events import BlockStored
from kvgate.engine.tokenizer import EngineTokenizer
from kvgate.loadtest.kit.report import RunMeta, publish, table
from kvgate.loadtest.kit.stats import best_microseconds
from kvgate.loadtest.kit.tiny_model import write_tiny_model
from kvgate.policies import RoutingConfig, build_policy, build_request_info
from kvgate.policies.precise_index import PrecisePrefixIndex

CONFIG = RoutingConfig()
REPLICAS = 16
BLOCK_SIZE = 16


def _chat_body(user_chars: int, variant: int = 0) -> dict[str, Any]:
    """A chat request with a system prompt and one user message of `user_chars` characters (`variant` varies it)."""
    words = f"the quick brown fox {variant} jumps over the lazy dog "
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Answer briefly."},
            {"role": "user", "content": (words * (user_chars // len(words) + 1))[:user_chars]},
        ],
        "stream": True,
    }


def _first_time_microseconds(tokenizer: EngineTokenizer, chars: int, count: int) -> float:
    """Tokenizing bodies whose text the tokenizer has not seen (nothing remembered), per body, in microseconds."""
    bodies = [_chat_body(chars, variant) for variant in range(1, count + 1)]
    started = time.perf_counter()
    for body in bodies:
        tokenizer.chat_ids(body)
    return (time.perf_counter() - started) / count * 1e6


def _pick_and_record(body: dict[str, Any], tokenizer: EngineTokenizer | None = None) -> Callable[[], object]:
    """One cache-aware pick and record on a fleet whose index holds this prefix (a tokenizer: precisely, on pod-5)."""
    precise = PrecisePrefixIndex() if tokenizer else None
    policy = build_policy("cache-aware", CONFIG, precise)
    fleet = FleetSnapshot(
        tuple(EndpointState(Endpoint(f"pod-{i}", f"http://10.0.0.{i}:8000"), in_flight=i % 3) for i in range(REPLICAS))
    )
    request = build_request_info("chat", body, "interactive", CONFIG)
    if tokenizer is not None and precise is not None:
        ids = tokenizer.chat_ids(body)
        request = dataclasses.replace(request, token_ids=tuple(ids))
        for state in fleet.endpoints:
            precise.set_precise(state.key, True)
        full = len(ids) // BLOCK_SIZE * BLOCK_SIZE
        precise.stored("pod-5", BlockStored(tuple(range(full // BLOCK_SIZE)), None, tuple(ids[:full]), BLOCK_SIZE))
    policy.record(request, fleet.endpoints[5])

    def run() -> None:
        decision = policy.pick(request, fleet)
        policy.record(request, decision.endpoint)

    return run


_HEADER = ("body", "orjson.loads (us)", "build_request_info (us)", "hashing / loads", "blocks",
           f"cache-aware pick+record, {REPLICAS} replicas (us)", "tokens", "engine tokenization, new text (us)",
           "the same, text seen before (us)", "precise pick+record (us)", "precise total, new text (us)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags of its own."""


def run(options: argparse.Namespace) -> int:
    """Time a 4 KB and a 200 KB chat body (--quick: the 4 KB one, fewer calls); write hashing.{json,md}."""
    meta = RunMeta()
    number = 20 if options.quick else 200
    with tempfile.TemporaryDirectory() as directory:
        tokenizer = EngineTokenizer.load(write_tiny_model(Path(directory)))
    rows = []
    for label, chars in (("4 KB chat", 4_000),) if options.quick else (("4 KB chat", 4_000), ("200 KB chat", 200_000)):
        body = _chat_body(chars)
        raw = orjson.dumps(body)
        parse = best_microseconds(lambda: orjson.loads(raw), number, 7)
        hashing = best_microseconds(lambda: build_request_info("chat", body, "interactive", CONFIG), number, 7)
        blocks = len(build_request_info("chat", body, "interactive", CONFIG).block_hashes)
        pick = best_microseconds(_pick_and_record(body), number, 7)
        first = _first_time_microseconds(tokenizer, chars, number if chars < 10_000 else 10)
        seen = best_microseconds(lambda: tokenizer.chat_ids(body), number, 7)
        tokens = len(tokenizer.chat_ids(body))
        precise = best_microseconds(_pick_and_record(body, tokenizer), number, 7)
        rows.append([f"{label} ({len(raw)} B)", round(parse, 1), round(hashing, 1), f"{hashing / parse:.2f}x", blocks,
                     round(pick, 1), tokens, round(first, 1), round(seen, 1), round(precise, 1),
                     round(first + precise, 1)])
    report = meta.finish(command=options.command) | {"header": _HEADER, "rows": rows}
    markdown = (f"Measured {report['date']} by `{options.command}` (best of 7 repeats of {number} calls each).\n\n"
                + "\n".join(table(_HEADER, rows)) + "\n")
    publish(options.out, "hashing", report, markdown, options.docs)
    return 0
