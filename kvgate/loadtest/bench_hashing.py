"""Cost of building RequestInfo (prefix hashing) next to parsing the same body, as a Markdown table.

Run: python -m kvgate.loadtest.bench_hashing
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import orjson

from kvgate.endpoints.model import Endpoint, EndpointState, FleetSnapshot
from kvgate.policies import RoutingConfig, build_policy, build_request_info

CONFIG = RoutingConfig()
REPLICAS = 16


def _chat_body(user_chars: int) -> dict[str, Any]:
    """A chat request with a system prompt and one user message of `user_chars` characters."""
    words = "the quick brown fox jumps over the lazy dog "
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Answer briefly."},
            {"role": "user", "content": (words * (user_chars // len(words) + 1))[:user_chars]},
        ],
        "stream": True,
    }


def _microseconds(call: Callable[[], object]) -> float:
    """Best per-call time over several repeats, in microseconds."""
    number = 200
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


def _pick_and_record(body: dict[str, Any]) -> Callable[[], object]:
    """One cache-aware pick plus record against a fleet whose index already holds this prefix."""
    policy = build_policy("cache-aware", CONFIG)
    fleet = FleetSnapshot(
        tuple(EndpointState(Endpoint(f"pod-{i}", f"http://10.0.0.{i}:8000"), in_flight=i % 3) for i in range(REPLICAS))
    )
    request = build_request_info("chat", body, "interactive", CONFIG)
    policy.record(request, fleet.endpoints[5])

    def run() -> None:
        decision = policy.pick(request, fleet)
        policy.record(request, decision.endpoint)

    return run


def main() -> None:
    """Print per-request costs for a 4 KB and a 200 KB chat body."""
    print("| body | orjson.loads (us) | build_request_info (us) | hashing / loads | blocks "
          f"| cache-aware pick+record, {REPLICAS} replicas (us) |")
    print("|---|---|---|---|---|---|")
    for label, chars in (("4 KB chat", 4_000), ("200 KB chat", 200_000)):
        body = _chat_body(chars)
        raw = orjson.dumps(body)
        parse = _microseconds(lambda: orjson.loads(raw))
        hashing = _microseconds(lambda: build_request_info("chat", body, "interactive", CONFIG))
        blocks = len(build_request_info("chat", body, "interactive", CONFIG).block_hashes)
        pick = _microseconds(_pick_and_record(body))
        print(f"| {label} ({len(raw)} B) | {parse:.1f} | {hashing:.1f} | {hashing / parse:.2f}x | {blocks} | {pick:.1f} |")


if __name__ == "__main__":
    main()
