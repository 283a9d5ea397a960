"""What a replica would cost a request, in seconds of time to first token: prefill it must redo, queueing it must wait.

    cost(replica) = (uncached prompt tokens + duplicated tokens) / prefill_tokens_per_second
                  + requests ahead of it in the replica's queue x queue_seconds_per_request

Duplicated tokens are the leading prompt tokens another candidate already holds and this one would store
again: what a request moved off the replica holding its context re-prefills. A replica's KV cache is full once
it has turned over (prefix caching keeps every freed block until it is needed), so storing them evicts as many
tokens of other prefixes, which their own requests then prefill again: a move costs its prefill twice, once now
for this request and once later for someone else. A prefix nobody holds yet duplicates nothing, so where it is
placed does not change; a tenant's new conversation, whose home is taken to hold the tenant's system prompt,
leaves that home only for a queue worth twice that prompt's prefill, as a move does.

A sequence the replica merely runs (a seat is free) lengthens each engine step by a fraction of a
millisecond: no term for it, since it would turn every tie between replicas holding the same context
into a least-loaded choice that scatters new context, for no time a prefill or a queue would notice.

Cache matches are counted in prompt tokens, the currency both the approximate index (blocks of
`block_chars` bytes at `chars_per_token`) and an engine-reported index (tokens the engine holds) speak.
The two rates are properties of the engine and model, not of a workload; see docs/routing.md for how
to read each one off a replica's own /metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.capacity import kv_seats, likely_seats, occupied
from kvgate.policies.config import RoutingConfig
from kvgate.policies.types import RequestInfo


def tokens_per_block(config: RoutingConfig, request: RequestInfo | None = None) -> float:
    """Prompt tokens in one prefix block of the approximate index: at the request's own characters per token where
    it was tokenized as its engine does (precise routing), else at the rate its replicas showed or the configured
    estimate (chars_per_token)."""
    if request is not None and request.token_ids and request.prompt_chars:
        return config.block_chars * len(request.token_ids) / request.prompt_chars
    return config.block_chars / chars_per_token(config, request)


def prompt_tokens(request: RequestInfo, config: RoutingConfig) -> int:
    """The request's prompt length in tokens: counted where it was tokenized as its engine does (precise routing),
    else estimated from its serialized size (chars_per_token)."""
    if request.token_ids:
        return len(request.token_ids)
    return max(1, round(request.prompt_chars / chars_per_token(config, request)))


def chars_per_token(config: RoutingConfig, request: RequestInfo | None = None) -> float:
    """Prompt characters per engine token: as the request's replicas showed them (PromptTokenRates), else the
    configured estimate."""
    return (request.chars_per_token if request is not None else None) or config.chars_per_token


def requests_ahead(state: EndpointState, uncached_tokens: int) -> int:
    """Requests a new one would wait behind on the replica, first come first served.

    vLLM's scheduler admits waiting requests in order and stops at the first one it cannot give a seat or
    KV blocks, so a new request waits behind the whole queue, whatever it waits for and however little of
    its own prompt is uncached: the scraped queue plus one when there is one, and at least what the replica
    holds beyond what it runs at once plus one: its seats where known (or likely: its peers'), fewer where its
    free KV blocks hold fewer prompts of the request's uncached tokens (kv_seats). A request sent since the scrape
    takes blocks as this one would, so requests decided on one scrape do not all count one replica's free blocks.
    """
    waiting = state.waiting  # fresh scrapes only: a stale one says nothing about now
    ahead = waiting + 1 if waiting else 0
    at_once = [count for count in (likely_seats(state) or None, kv_seats(state, uncached_tokens)) if count is not None]
    if at_once:
        ahead = max(ahead, occupied(state) - min(at_once) + 1)
    return ahead


class RequestCost:
    """The cost model: expected added time to first token of sending one request to each replica."""

    def __init__(self, config: RoutingConfig) -> None:
        self._config = config

    def seconds(self, request: RequestInfo, matched_tokens: Mapping[str, int], state: EndpointState) -> float:
        """Prefill of the tokens the replica does not hold, and again of those another holds (the evictions storing
        them again causes), plus queueing behind what it runs and waits for."""
        return self.seconds_each(request, matched_tokens, (state,))[state.key]

    def seconds_each(self, request: RequestInfo, matched_tokens: Mapping[str, int],
                     states: Sequence[EndpointState]) -> dict[str, float]:
        """`seconds` for each replica, the prompt's length and the most any candidate holds computed once."""
        config = self._config
        prompt, most = prompt_tokens(request, config), max(matched_tokens.values(), default=0)
        costs = {}
        for state in states:
            held = matched_tokens.get(state.key, 0)
            uncached = max(0, prompt - held)
            costs[state.key] = ((uncached + max(0, most - held)) / config.prefill_tokens_per_second
                                + requests_ahead(state, uncached) * config.queue_seconds_per_request)
        return costs
