"""The typed objects routing decisions are made from and expressed in."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.endpoints.types import EndpointState, FleetSnapshot


DEFAULT_FLOW = "default-flow"  # the Inference Extension's fairness id when a request names none


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """Everything routing needs from one request, computed once when its body is parsed."""

    model: str
    priority_class: str = "interactive"
    block_hashes: tuple[int, ...] = ()  # chained xxhash64 of the prompt's fixed-size blocks
    anchor_blocks: int = 0  # full blocks of a chat's instructions (tools, system prompt): what its tenant shares
    opening_blocks: int = 0  # full blocks up to the end of a chat's first own message: what its later turns repeat
    prompt_chars: int = 0
    stream: bool = False
    body_bytes: int = 0
    flow: str = DEFAULT_FLOW  # the Inference Extension's fairness id: flows of one class share the fleet
    cache_salt: str | None = None
    token_ids: tuple[int, ...] | None = None  # the prompt as the engine tokenizes it, when a tokenizer is configured
    anchor_tokens: int = 0  # of those, the ones a chat's anchor renders to (0: not tokenized, or no anchor)
    # prompt characters per engine token, learned from its replicas (policies/token_rate.py); None: not yet learned
    chars_per_token: float | None = None

    def at_rate(self, chars_per_token: float | None) -> RequestInfo:
        """The request with its prompt counted at `chars_per_token` (learned from its replicas; None: not yet)."""
        return self if chars_per_token is None else dataclasses.replace(self, chars_per_token=chars_per_token)


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's choice for one request."""

    endpoint: EndpointState
    reason: str  # one of REASONS
    matched_fraction: float = 0.0  # share of the request's blocks the chosen replica is believed to hold
    fallbacks: tuple[EndpointState, ...] = ()  # every other candidate, in the order a retry tries them
    moved_by: str = ""  # an overflow's cause: the filter that ruled out where it would have gone, or MOVED_BY_COST


REASONS = ("prefix_hit", "cold", "overflow", "fallback", "round_robin", "least_load")
MOVED_BY_COST = "cost"  # an overflow no filter caused: another replica was cheaper for the request


class Policy(Protocol):
    """A routing policy: chooses an endpoint and learns from what it chose."""

    name: str

    def pick(self, request: RequestInfo, fleet: FleetSnapshot) -> Decision | None:
        """Choose among `fleet.candidates(request.model)`; None when there is no candidate."""
        ...

    def record(self, request: RequestInfo, chosen: EndpointState) -> None:
        """Note that `request` was sent to `chosen` (prefix index, rotation state)."""
        ...

    def learn(self, request: RequestInfo, chosen: EndpointState, fleet: FleetSnapshot) -> None:
        """Note that another gateway sent `request` to `chosen` (router/peers.py), as `record` does for this one's."""
        ...

    def forget(self, endpoint_key: str) -> None:
        """Drop all state about an endpoint that left the fleet."""
        ...

    def holders(self, request: RequestInfo, candidates: Sequence[EndpointState], now: float) -> frozenset[str]:
        """The candidates that hold more of `request`'s prompt than the least of them; empty without an index."""
        ...

    def index_sizes(self) -> dict[str, int]:
        """Prefix blocks the policy believes each endpoint holds; empty for policies without an index."""
        ...

    def index_bytes(self) -> int:
        """Estimated memory of the policy's prefix index."""
        ...
