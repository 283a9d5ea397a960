"""What a replica would cost a request, in seconds of time to first token: prefill it must redo, queueing it must wait.

    cost(replica) = uncached prompt tokens / prefill_tokens_per_second
                  + requests ahead of it in the replica's queue x queue_seconds_per_request

A sequence the replica merely runs (a seat is free) lengthens each engine step by a fraction of a
millisecond: no term for it, since it would turn every tie between replicas holding the same context
into a least-loaded choice that scatters new context, for no time a prefill or a queue would notice.

Cache matches are counted in prompt tokens, the currency both the approximate index (blocks of
`block_chars` bytes at `chars_per_token`) and an engine-reported index (tokens the engine holds) speak.
The two rates are properties of the engine and model, not of a workload; see docs/routing.md for how
to read each one off a replica's own /metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.endpoints.model import EndpointState
from kvgate.policies.config import RoutingConfig
from kvgate.policies.types import RequestInfo


def tokens_per_block(config: RoutingConfig) -> float:
    """Prompt tokens in one prefix block of the approximate index."""
    return config.block_chars / config.chars_per_token


def prompt_tokens(request: RequestInfo, config: RoutingConfig) -> int:
    """The request's prompt length in tokens, estimated from its serialized size."""
    return max(1, round(request.prompt_chars / config.chars_per_token))


def requests_ahead(state: EndpointState, uncached_tokens: int) -> int:
    """Requests a new one would wait behind: for a seat (the replica's queue, plus one when every seat is taken),
    or for KV blocks when its uncached tokens do not fit in the free part of the replica's KV cache."""
    if state.seats:
        ahead = max(0, state.occupied - state.seats + 1)
    else:
        waiting = state.waiting  # fresh scrapes only: a stale one says nothing about now
        ahead = waiting + 1 if waiting else 0  # a replica that queues has every seat taken
    metrics = state.metrics
    capacity = metrics.kv_capacity_tokens
    if not ahead and not metrics.stale and capacity and uncached_tokens > (1.0 - metrics.kv_cache_usage) * capacity:
        ahead = 1  # it waits until a running sequence frees blocks
    return ahead


class RequestCost:
    """The cost model: expected added time to first token of sending one request to each replica."""

    def __init__(self, config: RoutingConfig) -> None:
        self._config = config

    def seconds(self, request: RequestInfo, matched_tokens: Mapping[str, int], state: EndpointState) -> float:
        """Prefill of the tokens the replica does not hold plus queueing behind what it runs and waits for."""
        config = self._config
        uncached = max(0, prompt_tokens(request, config) - matched_tokens.get(state.key, 0))
        return (
            uncached / config.prefill_tokens_per_second
            + requests_ahead(state, uncached) * config.queue_seconds_per_request
        )
