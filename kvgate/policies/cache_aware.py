"""The default policy: send each request where it costs least, placing prefixes nobody holds by rendezvous.

The cost (policies/cost.py) is the time to first token a replica would add: the prefill of the prompt
tokens it does not hold (twice for those another replica holds: storing them again evicts as many of other
prefixes), plus queueing behind what it runs and waits for. Cache matches are in tokens
(`Cycle.matched_tokens`), so any index that can say how many leading prompt tokens a replica holds can
feed the same decision.

1. Context: the part of the prompt no choice gains from is what every candidate holds, or the request's
   anchor (a chat's instructions: its system prompt and tools), which placement already follows. A
   request some replica holds more of than that (a conversation's earlier turns, say) continues where it
   is cheapest: only a hot spot (load over `hot_spot_bound` x the mean) is ruled out, so a replica a few
   requests over the mean keeps a conversation whose re-prefill would cost more than its queue.
2. Placement: a request no replica holds more of than that goes to the cheapest replica whose share of recent
   requests is under the bounded-load cap (CHWBL on shares over a few hundred requests, policies/balance.py: noise
   does not trip it, skewed popularity does), that is no hot spot, with a free seat when one exists. Which replicas
   hold the anchor by a gateway's own index is the fleet's history where the gateway knows of every request (it is
   alone, or its peers share their decisions: the fleet snapshot's `partial_view` is false,
   policies/traffic_view.py): the replica believed to hold most of it is the home, and a tenant nobody holds goes
   where the fewest recent requests went, a tenant new to the fleet counting there as the requests a typical tenant
   brings until its own add up (else new tenants arriving together would all follow the quietest replica), so tenants
   land evenly from their first request and stay, as the SGLang router's tree keeps them. A gateway that sees part of
   the traffic must not follow its own history, which its peers do not share: a busy tenant's assigned home
   (policies/tenants.py, a map every gateway computes alike) is taken to hold the anchor instead. Equal costs go to
   the home, then in the rendezvous order of the placement key. Where every candidate's KV events flow, which
   replicas hold the anchor is every gateway's truth: a replica that really holds it keeps the tenant's new
   conversations as it keeps a continuation (only a hot spot moves them), and the assigned home takes them where none
   does. The key is the chained hash at the end of the anchor (every gateway sends a tenant's new conversations to
   one home, whatever it has seen) or, without one, `affinity_blocks` blocks past the part every candidate holds
   (distinct prompts behind a common prefix spread by what follows it), and for a chat no deeper than its first own
   turn (so its later turns key where the first did, on every gateway). A busy home spills to the next replica in the
   key's own rendezvous order, which then holds it too: overflow concentrates on a few replicas instead of spraying
   the fleet. A chat's later turn that looks new to this gateway (several gateways share the traffic, and another
   placed its earlier turns) is taken to be at its tenant's home, history included, and is routed as a continuation:
   the share bound does not push it off the replica that holds its history.
Reasons: "prefix_hit" (the chosen replica holds the most, and more than some other), "cold" (the home, nobody
holding more), "overflow" (load moved it off either; the decision's `moved_by` names the filter that ruled that
replica out, or "cost" where its queue cost more than the miss), "fallback" (every candidate was over its cap: the
least loaded).

Where a replica's KV events flow (a PrecisePrefixIndex that knows its state) its match is the truth: the
leading prompt tokens it really holds; elsewhere, the approximate index's belief, in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvgate.endpoints.types import EndpointState, FleetSnapshot
from kvgate.policies.balance import RecentRequests, balance_window
from kvgate.policies.config import RoutingConfig
from kvgate.policies.cost import prompt_tokens, tokens_per_block
from kvgate.policies.framework import Cycle
from kvgate.policies.precise_index import PrecisePrefixIndex
from kvgate.policies.prefix_index import PrefixIndex, index_capacity_blocks
from kvgate.policies.profile import continuation_profile, placement_profile
from kvgate.policies.rendezvous import least_loaded_order, placement_key, rendezvous_order, retry_order
from kvgate.policies.tenants import TenantPlacement
from kvgate.policies.types import MOVED_BY_COST, Decision, RequestInfo


class Observation(NamedTuple):
    """A request as a decision sees it: each candidate's match, the placement key, the leading tokens no choice
    gains from, and the model's tenant map."""

    matched: dict[str, int]
    all_precise: bool  # every candidate's match came from its KV events
    key: int
    shared: int
    tenants: TenantPlacement


def _carries_history(request: RequestInfo) -> bool:
    """Whether a chat carries turns past its first own message (more than a block past its opening)."""
    return bool(request.opening_blocks) and len(request.block_hashes) >= request.opening_blocks + 2


class CacheAwarePolicy:
    """Lowest expected time to first token, prefix cache included, under consistent hashing with bounded loads."""

    name = "cache-aware"

    def __init__(self, config: RoutingConfig, precise: PrecisePrefixIndex | None = None) -> None:
        self._config = config
        self._recent = RecentRequests()
        self._window = balance_window(1, config.load_bound)
        self._placement = placement_profile(config, self._recent)
        self._continuation = continuation_profile(config)
        self._tenants: dict[str, TenantPlacement] = {}  # per served model
        self.index = PrefixIndex(config.index_max_total_blocks)
        self.precise = precise

    def holders(self, request: RequestInfo, candidates: Sequence[EndpointState], now: float) -> frozenset[str]:
        """The candidates that hold more of `request`'s prompt than the least of them (matched_tokens)."""
        if not candidates:
            return frozenset()
        matched, _ = self.matched_tokens(request, candidates, now)
        least = min(matched.values())
        return frozenset(key for key, tokens in matched.items() if tokens > least)

    def matched_tokens(self, request: RequestInfo, candidates: Sequence[EndpointState],
                       now: float = 0.0) -> tuple[dict[str, int], bool]:
        """Per candidate, the leading prompt tokens it holds: precise where its KV events flow, believed elsewhere;
        and whether the events told them all."""
        precise = self.precise.match_tokens(((s.key, s.metrics.block_size) for s in candidates), request.token_ids,
                                            request.model, request.cache_salt, now) \
            if self.precise is not None and request.token_ids else {}
        per_block = tokens_per_block(self._config, request)
        total = prompt_tokens(request, self._config)
        matched = {
            state.key: precise[state.key] if state.key in precise
            else min(total, round(self.index.match(state.key, request.block_hashes) * per_block))
            for state in candidates
        }
        return matched, len(precise) == len(candidates)

    def pick(self, request: RequestInfo, fleet: FleetSnapshot) -> Decision | None:
        """Choose a replica for `request` among the fleet's candidates for its model."""
        candidates = fleet.candidates(request.model)
        if not candidates:
            return None
        matched, all_precise, key, shared, tenants = self._observe(request, candidates, fleet.now)
        everywhere = min(matched.values())
        if any(tokens > shared for tokens in matched.values()):
            cycle, profile = Cycle(request, key, matched), self._continuation
        else:
            # The tenant map is followed on every placement, so that it is current whichever way this one goes.
            home, profile = tenants.home(key, candidates), self._placement
            if all_precise:
                # Every candidate's KV events flow: which replicas hold the anchor is every gateway's truth, and the
                # tenant's assigned home, which every gateway computes alike, takes it where none does.
                seen = matched
                if max(matched.values()) > everywhere:
                    # Some replica really holds what it shares with its tenant's conversations: cached context, kept
                    # where it is held as a continuation is (only a hot spot moves it; the share bound would have it
                    # prefill the system prompt again elsewhere and evict as much there).
                    profile = self._continuation
            elif fleet.partial_view:
                # This gateway knows of part of the traffic, so what its own index says about the anchor is its own
                # history, which must not count: the tenant's assigned home is taken to hold it, no other replica.
                seen = {endpoint: shared if home in (None, endpoint) else everywhere for endpoint in matched}
            else:
                # This gateway knows of every request (alone, or its peers share their decisions): its index is the
                # fleet's history, the same on every gateway. New context stays where its tenant's conversations
                # are, and a tenant new to the fleet goes where the fewest requests went lately.
                seen = {endpoint: min(tokens, shared) for endpoint, tokens in matched.items()}
                home = self._believed_home(key, seen, candidates)
            if not all_precise and home is not None and _carries_history(request):
                # A later turn whose earlier ones this gateway never placed (another gateway did) is where its
                # tenant's conversations go, history and all, and stays there as a continuation would.
                seen[home], profile = prompt_tokens(request, self._config), self._continuation
            cycle = Cycle(request, key, seen, home)
        eligible = profile.filter(cycle, candidates)
        if not eligible:
            ranked, reason, passed_over = least_loaded_order(key, candidates), "fallback", None
        else:
            ranked = profile.rank(cycle, eligible)
            reason, passed_over = self._reason(cycle, ranked[0], candidates)
        moved_by = "" if passed_over is None else profile.ruled_out_by(cycle, candidates, passed_over) or MOVED_BY_COST
        decision = self._decision(request, matched, ranked, retry_order(key, ranked, candidates), reason, moved_by)
        self._pledge_if_new(key, decision.endpoint.key, tenants)
        return decision

    def _observe(self, request: RequestInfo, candidates: tuple[EndpointState, ...], now: float) -> Observation:
        """What a decision about `request` starts from, with the request counted in its tenant's popularity: this
        gateway's own decisions and its peers' (`learn`) alike."""
        self._window = balance_window(len(candidates), self._config.load_bound)
        matched, all_precise = self.matched_tokens(request, candidates, now)
        everywhere, per_block = min(matched.values()), tokens_per_block(self._config, request)
        # A chat's anchor and the block straddling its end (the next message's role and first words, which many
        # conversations share) are what a tenant's conversations have in common, not any conversation's own. Where
        # the engine's tokenizer counted the anchor, in the tokens a replica's KV events report.
        anchor = request.anchor_tokens or round(request.anchor_blocks * per_block)
        shared = max(everywhere, anchor + round(per_block)) if request.anchor_blocks else everywhere
        depth = request.anchor_blocks or int(everywhere / per_block) + self._config.affinity_blocks
        if request.opening_blocks:  # no deeper than a chat's first turn, so that its later turns key alike
            depth = min(depth, request.opening_blocks)
        key = placement_key(request, depth)
        tenants = self._tenants.setdefault(request.model, TenantPlacement())
        tenants.observe(key, self._window)
        return Observation(matched, all_precise, key, shared, tenants)

    def _believed_home(self, key: int, seen: dict[str, int], candidates: tuple[EndpointState, ...]) -> str:
        """Where new context goes by the fleet's history: the replica believed to hold most of what it shares with its
        tenant's conversations, else the one the fewest recent requests went to; ties in the key's rendezvous order."""
        order = rendezvous_order(key, candidates)
        most = max(seen.values())
        if most > min(seen.values()):
            return next(state.key for state in order if seen[state.key] == most)
        return min(order, key=lambda state: self._recent.expected(state.key)).key

    def _pledge_if_new(self, key: int, chosen: str, tenants: TenantPlacement) -> None:
        """A request whose placement key was not seen lately (a tenant new to the fleet) brings the requests of a
        typical tenant to `chosen`: pledged there, so that the next new tenants do not all follow it to the replica
        that had the fewest requests until its own add up."""
        if tenants.is_new(key):
            self._recent.pledge(chosen, tenants.unit)

    @staticmethod
    def _reason(cycle: Cycle, chosen: EndpointState, candidates: tuple[EndpointState, ...]) -> tuple[str, str | None]:
        """Why `chosen`, and for an overflow the replica it passed over: one holding the most, or the home."""
        matched = cycle.matched_tokens
        most, least = max(matched.values()), min(matched.values())
        if matched[chosen.key] < most:
            return "overflow", max(matched, key=matched.__getitem__)
        if most > least:
            return "prefix_hit", None
        home = cycle.home or rendezvous_order(cycle.placement_key, candidates)[0].key
        return ("cold", None) if chosen.key == home else ("overflow", home)

    def record(self, request: RequestInfo, chosen: EndpointState) -> None:
        """The chosen replica now caches the request's blocks, and has one more recent request."""
        capacity = index_capacity_blocks(chosen.metrics, self._config, request.chars_per_token)
        self.index.record(chosen.key, request.block_hashes, capacity)
        self._recent.record(chosen.key, self._window)
        if self.precise is not None and request.token_ids:
            self.precise.hold(chosen.key, chosen.metrics.block_size, request.token_ids, request.model,
                              request.cache_salt)

    def learn(self, request: RequestInfo, chosen: EndpointState, fleet: FleetSnapshot) -> None:
        """Another gateway sent `request` to `chosen`: believe what it caches there, count its recent request and
        its tenant's popularity as if this gateway had placed it, so that every gateway follows the same state."""
        candidates = fleet.candidates(request.model)
        if all(state.key != chosen.key for state in candidates):
            return
        observation = self._observe(request, candidates, fleet.now)
        self._pledge_if_new(observation.key, chosen.key, observation.tenants)
        self.record(request, chosen)

    def forget(self, endpoint_key: str) -> None:
        """Drop what the approximate index believes an endpoint holds (it left, or its cache may be gone), and its
        recent requests."""
        self.index.forget(endpoint_key)
        self._recent.forget(endpoint_key)

    def index_sizes(self) -> dict[str, int]:
        """Prefix blocks believed held per endpoint."""
        return self.index.sizes()

    def index_bytes(self) -> int:
        """Estimated memory of the prefix index."""
        return self.index.approx_bytes

    def _decision(self, request: RequestInfo, matched: dict[str, int], ranked: list[EndpointState],
                  fallbacks: tuple[EndpointState, ...], reason: str, moved_by: str) -> Decision:
        chosen = ranked[0]
        fraction = matched[chosen.key] / prompt_tokens(request, self._config)
        return Decision(chosen, reason, matched_fraction=min(fraction, 1.0), fallbacks=fallbacks, moved_by=moved_by)
