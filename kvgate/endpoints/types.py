"""Typed objects describing the fleet: endpoints, their scraped load, and immutable snapshots of both.

This module is pure data (no I/O) so that `policies/` can depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One vLLM replica as discovery reports it."""

    key: str  # stable identity: "namespace/pod" under Kubernetes, the URL for a static list
    url: str  # base URL without a trailing slash, e.g. "http://10.0.0.7:8000"
    accepting: bool = True  # may take new requests (EndpointSlice `ready`)
    pool: str = "default"

    @property
    def address(self) -> str:
        """`host:port` of the URL, as the Inference Extension's endpoint picker protocol names endpoints."""
        return urlsplit(self.url).netloc


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """What the last successful scrape of a replica's `/metrics` said."""

    kv_cache_usage: float = 0.0  # fraction 0..1 of KV blocks in use
    running: int = 0
    waiting: int = 0
    block_size: int | None = None  # tokens per KV block (vllm:cache_config_info)
    num_gpu_blocks: int | None = None
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    engine_steps: int | None = None  # engine steps so far (vllm:iteration_tokens_total's count), None if not exported
    # requests it finished so far and their prompt tokens (vllm:request_prompt_tokens' count and sum), None if not
    # exported
    finished_requests: int | None = None
    finished_prompt_tokens: int | None = None
    scraped_at: float | None = None  # clock value of the last successful scrape, None if never
    stale: bool = True  # the last scrape failed, was late, or never happened

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the replica's KV cache can hold, when cache_config_info was scraped."""
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None


UNSCRAPED = ReplicaMetrics()


@dataclass(frozen=True, slots=True)
class EndpointState:
    """An endpoint with everything routing knows about it at one instant."""

    endpoint: Endpoint
    metrics: ReplicaMetrics = UNSCRAPED
    in_flight: int = 0  # requests this gateway has open on the replica
    models: frozenset[str] = frozenset()  # served models and adapters; empty while unknown
    healthy: bool = True  # passive health: False while its circuit breaker is open
    recent: int = 0  # requests sent minus requests finished since the replica's last successful scrape
    # requests this gateway has open on it now less those it had open when that scrape started: the net growth
    # since the page (a request that replaced one finished while the scrape was in flight is no growth)
    grown: int = 0
    # KV cache tokens this gateway's in-flight requests hold on it now less those they held when that scrape started,
    # each shared prefix block once (policies/held_kv.py)
    kv_grown: float = 0.0
    elsewhere: int = 0  # requests other gateways sent to it since that scrape (their KV cache is not in kv_grown)
    seats: int | None = None  # sequences it runs at once (vLLM --max-num-seqs): configured or learned; None unknown
    # while its own seats are unknown: the fewest learned on another replica serving one of its models (peer_seats)
    peer_seats: int | None = None
    filled: bool = False  # it has been full, for its seats or its KV cache (SeatLearner.filled)
    chars_per_token: float | None = None  # prompt characters per token its engine counted; None until learned

    @property
    def key(self) -> str:
        """The endpoint's stable identity."""
        return self.endpoint.key

    @property
    def waiting(self) -> int:
        """Queue depth from the last fresh scrape, 0 when metrics are stale."""
        return 0 if self.metrics.stale else self.metrics.waiting

    def serves(self, model: str) -> bool:
        """Whether the replica serves `model`; an endpoint whose model list is unknown is assumed to."""
        return not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Immutable view of every known endpoint at one instant; what policies decide on."""

    endpoints: tuple[EndpointState, ...]
    now: float = 0.0
    partial_view: bool = False  # this gateway knows of only part of its replicas' traffic (policies/traffic_view.py)
    # candidates() per model: admission, preemption and the pick all ask for them about one request
    _candidates: dict[str, tuple[EndpointState, ...]] = field(default_factory=dict, init=False, repr=False,
                                                               compare=False)

    def candidates(self, model: str) -> tuple[EndpointState, ...]:
        """Endpoints that serve `model`, accept new requests and are healthy.

        When every such endpoint's breaker is open, all of them are candidates: failing open beats failing
        every request on the word of a breaker.
        """
        found = self._candidates.get(model)
        if found is None:
            serving = tuple(s for s in self.endpoints if s.endpoint.accepting and s.serves(model))
            found = self._candidates[model] = tuple(s for s in serving if s.healthy) or serving
        return found

    def restricted(self, keep: Callable[[EndpointState], bool]) -> FleetSnapshot:
        """The same instant with only the endpoints `keep` accepts."""
        return FleetSnapshot(endpoints=tuple(s for s in self.endpoints if keep(s)), now=self.now,
                             partial_view=self.partial_view)

    def known_models(self) -> frozenset[str]:
        """Union of the models every endpoint reports."""
        return frozenset().union(*(s.models for s in self.endpoints))

    def get(self, key: str) -> EndpointState | None:
        """The endpoint with this key, if present."""
        for state in self.endpoints:
            if state.key == key:
                return state
        return None
