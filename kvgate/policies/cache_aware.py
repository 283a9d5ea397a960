"""The default policy: follow the prefix cache while loads stay bounded, place new prefixes by rendezvous.

1. Bounded load: a candidate whose load is at the CHWBL cap (policies/filters.py) gets no new work;
   if every one is (only possible with load_bound < 1), the least loaded is taken ("fallback").
2. Hot: when some eligible replica holds more of the prompt than every candidate does and more than
   its anchor (a system prompt cached everywhere says nothing about where to go, and the anchor is
   what cold placement already follows), the weighted scorers decide ("prefix_hit", or "overflow"
   when the replica holding the most was over the cap).
3. Cold: otherwise the first eligible replica in the rendezvous order of the prompt's placement key
   ("cold", or "overflow" when the rendezvous home was over the cap or had no free seat while another
   one had: a request no cache favours never waits for a seat). The key is the chained hash at the
   end of the request's anchor (a chat's first message, usually its system prompt: every gateway
   sends a tenant's new conversations to one home, whatever it has seen), or, without an anchor,
   `affinity_blocks` blocks past the part every candidate holds, so distinct prompts behind a
   common prefix spread by what follows it.
A hot prefix whose holders are full therefore spills to the next replica in its own rendezvous
order, which then holds it too: overflow concentrates instead of spraying the fleet.

Where a replica's KV events flow (a PrecisePrefixIndex that knows its state) its match is the truth:
the leading prompt tokens it really holds, expressed in prefix blocks of the request's own characters
per token so that it compares with the approximate belief about the replicas without events.
"""

from __future__ import annotations

from kvgate.endpoints.types import EndpointState, FleetSnapshot
from kvgate.policies.config import RoutingConfig
from kvgate.policies.filters import FreeSeatFilter
from kvgate.policies.framework import Cycle
from kvgate.policies.precise_index import PrecisePrefixIndex
from kvgate.policies.prefix_index import PrefixIndex, index_capacity_blocks
from kvgate.policies.profile import build_profile
from kvgate.policies.rendezvous import least_loaded_order, placement_key, rendezvous_order
from kvgate.policies.types import Decision, RequestInfo


class CacheAwarePolicy:
    """Prefix-cache affinity under consistent hashing with bounded loads."""

    name = "cache-aware"

    def __init__(self, config: RoutingConfig, precise: PrecisePrefixIndex | None = None) -> None:
        self._config = config
        self._profile = build_profile(config)
        self._seated = FreeSeatFilter()
        self.index = PrefixIndex(config.index_max_total_blocks)
        self.precise = precise

    def pick(self, request: RequestInfo, fleet: FleetSnapshot) -> Decision | None:
        """Choose a replica for `request` among the fleet's candidates for its model."""
        candidates = fleet.candidates(request.model)
        if not candidates:
            return None
        matched = self._matched_blocks(request, candidates, fleet.now)
        # The part no choice can gain from: held everywhere, or the anchor, which cold placement already follows.
        shared = max(min(matched.values()), request.anchor_blocks)
        depth = request.anchor_blocks or shared + self._config.affinity_blocks
        cycle = Cycle(request, placement_key(request, depth), matched)
        eligible = self._profile.filter(cycle, candidates)
        if not eligible:
            return self._decision(cycle, least_loaded_order(cycle.placement_key, candidates), "fallback")
        best_eligible = max(matched[state.key] for state in eligible)
        if best_eligible > shared:
            overflowed = max(matched.values()) > best_eligible
            return self._decision(cycle, self._profile.rank(cycle, eligible), "overflow" if overflowed else "prefix_hit")
        ranked = rendezvous_order(cycle.placement_key, self._seated.filter(cycle, eligible))
        home = rendezvous_order(cycle.placement_key, candidates)[0]
        return self._decision(cycle, ranked, "cold" if ranked[0].key == home.key else "overflow")

    def _matched_blocks(self, request: RequestInfo, candidates: tuple[EndpointState, ...], now: float) -> dict[str, int]:
        """Leading prefix blocks each candidate holds: precise where its events flow, believed elsewhere."""
        tokens = request.token_ids
        precise = self.precise.match_tokens(((s.key, s.metrics.block_size) for s in candidates), tokens,
                                            request.model, request.cache_salt, now) \
            if self.precise is not None and tokens else {}
        blocks_per_token = request.prompt_chars / len(tokens) / self._config.block_chars if tokens else 0.0
        return {state.key: min(int(precise[state.key] * blocks_per_token), len(request.block_hashes))
                if state.key in precise else self.index.match(state.key, request.block_hashes)
                for state in candidates}

    def record(self, request: RequestInfo, chosen: EndpointState) -> None:
        """The chosen replica now caches the request's blocks."""
        capacity = index_capacity_blocks(chosen.metrics, self._config)
        self.index.record(chosen.key, request.block_hashes, capacity)
        if self.precise is not None and request.token_ids:
            self.precise.hold(chosen.key, chosen.metrics.block_size, request.token_ids, request.model,
                              request.cache_salt)

    def forget(self, endpoint_key: str) -> None:
        """Drop what the approximate index believes an endpoint holds (it left, or its cache may be gone)."""
        self.index.forget(endpoint_key)

    def index_sizes(self) -> dict[str, int]:
        """Prefix blocks believed held per endpoint."""
        return self.index.sizes()

    def index_bytes(self) -> int:
        """Estimated memory of the prefix index."""
        return self.index.approx_bytes

    @staticmethod
    def _decision(cycle: Cycle, ranked: list[EndpointState], reason: str) -> Decision:
        chosen = ranked[0]
        total = len(cycle.request.block_hashes)
        fraction = cycle.matched_blocks[chosen.key] / total if total else 0.0
        return Decision(chosen, reason, matched_fraction=fraction, fallbacks=tuple(ranked[1:]))
