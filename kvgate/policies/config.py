"""Routing configuration: the knobs of request hashing, the prefix index, scorers and the picker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingConfig:
    """Tunables for request hashing, the prefix index and the cache-aware cost model (policies/cost.py)."""

    block_chars: int = 64  # UTF-8 bytes of serialized prompt per prefix block (about 16 tokens; 16 token ids)
    max_blocks: int = 256  # blocks hashed per request; later text is ignored for routing
    affinity_blocks: int = 4  # leading blocks whose hash places a cold prefix (rendezvous)
    load_bound: float = 1.25  # a replica over bound x mean load gets no prefix it does not hold yet
    load_slack: int = 2  # ... nor over mean + slack, whichever is higher (a low-load bound otherwise fires on noise)
    hot_spot_bound: float = 2.0  # a replica over this x mean load gets no request at all, cached context or not
    # The cost model, in the engine's own terms (docs/routing.md says how to read them off vLLM's /metrics):
    prefill_tokens_per_second: float = 10_000.0  # a replica's prefill throughput for uncached prompt tokens
    queue_seconds_per_request: float = 0.05  # wait each request ahead in a replica's queue adds (request time / seats)
    index_default_blocks: int = 31_250  # per-replica index size when the KV capacity is unknown
    index_max_total_blocks: int = 1_000_000  # all replicas together, about 145 B each: ~145 MB worst case
    chars_per_token: float = 4.0  # prompt characters per engine token until the replicas teach theirs (token_rate.py)
