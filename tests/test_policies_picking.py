"""Scorers, filters, the profile, and every routing policy: choices, reasons, determinism, balance."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.endpoints.types import Endpoint, EndpointState, FleetSnapshot, ReplicaMetrics
from kvgate.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    REASONS,
    BoundedLoadFilter,
    CacheAwarePolicy,
    Cycle,
    LowestCostPicker,
    Policy,
    RequestCost,
    RequestInfo,
    RoutingConfig,
    build_policy,
    build_request_info,
    prompt_tokens,
)
from kvgate.policies.balance import NOISE_SIGMAS, balance_window
from kvgate.policies.capacity import occupied
from kvgate.policies.filters import load_cap
from kvgate.policies.precise_index import PrecisePrefixIndex
from kvgate.policies.rendezvous import placement_key, rendezvous_order

CONFIG = RoutingConfig(load_slack=0)  # the bare multiplicative bound: the small loads below exercise it
KEYS = [f"pod-{i}" for i in range(8)]


def state(key: str, in_flight: int = 0, **metrics: object) -> EndpointState:
    scraped = ReplicaMetrics(**metrics) if metrics else ReplicaMetrics()
    return EndpointState(Endpoint(key, f"http://{key}:8000"), metrics=scraped, in_flight=in_flight)


def fleet_of(*states: EndpointState, partial_view: bool = False) -> FleetSnapshot:
    return FleetSnapshot(tuple(states), partial_view=partial_view)


def idle_fleet(keys: list[str] = KEYS, loads: dict[str, int] | None = None, partial_view: bool = False) -> FleetSnapshot:
    """Replicas with these in-flight loads; `partial_view`: as a gateway that knows of part of their traffic sees them."""
    return fleet_of(*(state(key, (loads or {}).get(key, 0)) for key in keys), partial_view=partial_view)


def request(text: str) -> RequestInfo:
    return build_request_info("completion", {"model": "m", "prompt": text}, "interactive", CONFIG)


def prompt(name: str, blocks: int = 6) -> str:
    return (f"{name} " * (blocks * CONFIG.block_chars))[: blocks * CONFIG.block_chars]


def home_of(req: RequestInfo, fleet: FleetSnapshot) -> str:
    return rendezvous_order(placement_key(req, CONFIG.affinity_blocks), fleet.endpoints)[0].key


def within_bound(name: str, in_flight: Counter[str], keys: list[str]) -> bool:
    """Whether the busiest replica is within a policy's in-flight bound (the pick it just made included).

    cache-aware lets a request that continues cached context go up to a hot spot: `hot_spot_bound` x the
    mean and three deviations of Poisson noise over it.
    """
    loads = [in_flight[key] for key in keys]
    before = sum(loads) - 1
    if name == "cache-aware":
        return max(loads) <= load_cap([before / len(keys)] * len(keys), CONFIG.hot_spot_bound, CONFIG.load_slack,
                                      NOISE_SIGMAS)
    return max(loads) <= math.ceil(CONFIG.load_bound * sum(loads) / len(keys)) + 1


def cycle_for(req: RequestInfo, matched: dict[str, int] | None = None) -> Cycle:
    return Cycle(req, placement_key(req, CONFIG.affinity_blocks), matched or {})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=16), st.floats(1.0, 3.0))
def test_bounded_load_filter_always_leaves_a_candidate_when_bound_is_at_least_one(
    loads: list[int], bound: float
) -> None:
    states = [state(f"e{i}", load) for i, load in enumerate(loads)]
    eligible = BoundedLoadFilter(bound).filter(cycle_for(request("x")), states)
    assert eligible
    assert min(states, key=occupied) in eligible


def test_bounded_load_cap_lets_tiny_loads_through() -> None:
    cycle = cycle_for(request("x"))
    assert len(BoundedLoadFilter(1.25).filter(cycle, [state(k) for k in "abcd"])) == 4
    one_busy = [state("a", 1), state("b"), state("c"), state("d")]
    assert [s.key for s in BoundedLoadFilter(1.25).filter(cycle, one_busy)] == ["b", "c", "d"]


def test_the_load_bound_reads_what_a_replica_holds_not_what_this_gateway_sent_there() -> None:
    """Another gateway's requests on a replica make it a hot spot here too: every gateway bounds alike."""
    cycle = cycle_for(request("x"))
    busy_elsewhere = state("a", 0, running=20, scraped_at=1.0, stale=False)
    idle = [state(k, 0, running=0, scraped_at=1.0, stale=False) for k in "bc"]
    assert [s.key for s in BoundedLoadFilter(1.25).filter(cycle, [busy_elsewhere, *idle])] == ["b", "c"]


def test_registry_builds_every_policy_by_name() -> None:
    assert DEFAULT_POLICY == "cache-aware"
    assert set(POLICY_NAMES) == {"cache-aware", "prefix-hash", "least-load", "round-robin"}
    for name in POLICY_NAMES:
        policy: Policy = build_policy(name, CONFIG)
        assert policy.name == name
        policy.record(request(prompt("a")), state("pod-0"))
        assert sum(policy.index_sizes().values()) == (6 if name == "cache-aware" else 0)
    with pytest.raises(ValueError, match="round-robin"):
        build_policy("random", CONFIG)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policies_choose_only_candidates_that_may_take_the_request(name: str) -> None:
    policy = build_policy(name, CONFIG)
    draining = EndpointState(Endpoint("draining", "http://d", accepting=False))
    broken = EndpointState(Endpoint("broken", "http://b"), healthy=False)
    other_model = EndpointState(Endpoint("other", "http://o"), models=frozenset({"other"}))
    assert policy.pick(request("x"), fleet_of(draining, other_model)) is None
    # When every candidate's breaker is open the fleet fails open rather than failing every request.
    assert policy.pick(request("x"), fleet_of(draining, broken, other_model)).endpoint.key == "broken"
    assert policy.pick(request("x"), FleetSnapshot(())) is None
    fleet = fleet_of(draining, broken, other_model, state("ok-1"), state("ok-2"))
    for i in range(20):
        decision = policy.pick(request(prompt(f"p{i}")), fleet)
        assert decision is not None and decision.reason in REASONS
        assert decision.endpoint.key in {"ok-1", "ok-2"}
        assert {s.key for s in decision.fallbacks} <= {"ok-1", "ok-2"} - {decision.endpoint.key}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_stale_metrics_never_hide_a_candidate(name: str) -> None:
    policy = build_policy(name, CONFIG)
    fleet = fleet_of(*(state(k, stale=True, waiting=1000, kv_cache_usage=1.0) for k in KEYS[:3]))
    chosen = Counter()
    for i in range(60):
        decision = policy.pick(request(prompt(f"s{i}")), fleet)
        assert decision is not None
        chosen[decision.endpoint.key] += 1
    assert set(chosen) == set(KEYS[:3])


def test_round_robin_is_fair_and_survives_membership_changes() -> None:
    policy = build_policy("round-robin", CONFIG)
    fleet = idle_fleet(KEYS[:4])
    picks = [policy.pick(request("x"), fleet) for _ in range(400)]
    assert Counter(d.endpoint.key for d in picks) == {key: 100 for key in KEYS[:4]}
    assert [s.key for s in picks[0].fallbacks] == KEYS[1:4]
    assert policy.pick(request("x"), idle_fleet(KEYS[:2] + KEYS[3:4])).endpoint.key == KEYS[0]
    assert policy.pick(request("x"), idle_fleet(KEYS[1:2] + KEYS[3:4])).endpoint.key == KEYS[1]


def test_least_load_picks_lowest_load_and_breaks_ties_by_prefix_not_position() -> None:
    policy = build_policy("least-load", CONFIG)
    loaded = idle_fleet(KEYS[:4], loads={"pod-0": 3, "pod-1": 1, "pod-2": 0, "pod-3": 2})
    decision = policy.pick(request("x"), loaded)
    assert decision.endpoint.key == "pod-2"
    assert [s.key for s in decision.fallbacks] == ["pod-1", "pod-3", "pod-0"]
    tie_winners = Counter()
    for i in range(200):
        req = request(prompt(f"t{i}"))
        forward = policy.pick(req, idle_fleet(KEYS[:4])).endpoint.key
        backward = policy.pick(req, idle_fleet(KEYS[3::-1])).endpoint.key
        assert forward == backward
        tie_winners[forward] += 1
    assert min(tie_winners[key] for key in KEYS[:4]) > 20


def test_prefix_hash_sends_a_prefix_home_until_home_is_over_the_bound() -> None:
    policy = build_policy("prefix-hash", CONFIG)
    req = request(prompt("tenant-7"))
    fleet = idle_fleet()
    home = home_of(req, fleet)
    shuffled = fleet_of(*random.Random(3).sample(fleet.endpoints, len(fleet.endpoints)))
    assert policy.pick(req, fleet).endpoint.key == home == policy.pick(req, shuffled).endpoint.key
    assert policy.pick(req, fleet).reason == "cold"
    busy = idle_fleet(loads={home: 5})
    decision = policy.pick(req, busy)
    assert (decision.reason, decision.endpoint.key) == ("overflow", rendezvous_order(
        placement_key(req, CONFIG.affinity_blocks), busy.endpoints)[1].key)
    assert (decision.moved_by, policy.pick(req, fleet).moved_by) == ("bounded-load", "")
    below_one = build_policy("prefix-hash", RoutingConfig(load_bound=0.5, load_slack=0))
    assert below_one.pick(req, idle_fleet(KEYS[:4], {k: 2 for k in KEYS[:4]})).reason == "fallback"


def test_cache_aware_places_a_new_prefix_at_its_rendezvous_home() -> None:
    policy = build_policy("cache-aware", CONFIG)
    fleet = idle_fleet()
    for i in range(30):
        req = request(prompt(f"new-{i}"))
        decision = policy.pick(req, fleet)
        assert (decision.reason, decision.endpoint.key) == ("cold", home_of(req, fleet))
        assert len(decision.fallbacks) == len(KEYS) - 1


def tenant_chat(tenant: str, user: str) -> RequestInfo:
    messages = [{"role": "system", "content": prompt(f"tenant-{tenant}", 20)}, {"role": "user", "content": user}]
    return build_request_info("chat", {"model": "m", "messages": messages}, "interactive", CONFIG)


def test_a_tenants_new_conversations_go_to_one_home_whatever_a_gateway_has_seen() -> None:
    fleet = idle_fleet()
    fresh, seasoned = build_policy("cache-aware", CONFIG), build_policy("cache-aware", CONFIG)
    first = tenant_chat("t", "hello")
    elsewhere = next(state for state in fleet.endpoints if state.key != home_of(first, fleet))
    seasoned.record(first, elsewhere)  # this gateway once sent the tenant's system prompt somewhere else
    homes = set()
    for i in range(20):
        req = tenant_chat("t", f"question {i}")
        choices = {policy.pick(req, fleet).endpoint.key for policy in (fresh, seasoned)}
        assert len(choices) == 1  # two gateways that never talked agree
        homes |= choices
    assert len(homes) == 1  # and the tenant's conversations share its cached system prompt
    long_turn = tenant_chat("t", prompt("long question", 8))
    seasoned.record(long_turn, elsewhere)
    decision = seasoned.pick(long_turn, fleet)  # where its history is cached beyond the system prompt
    assert (decision.reason, decision.endpoint.key) == ("prefix_hit", elsewhere.key)


def test_cache_aware_follows_the_replica_that_holds_the_prefix() -> None:
    policy = build_policy("cache-aware", CONFIG)
    fleet = idle_fleet()
    turn1 = request(prompt("conversation", blocks=8))
    holder = next(s for s in fleet.endpoints if s.key != home_of(turn1, fleet))
    policy.record(turn1, holder)
    turn2 = request(prompt("conversation", blocks=8) + prompt("reply", blocks=2))
    decision = policy.pick(turn2, fleet)
    assert (decision.reason, decision.endpoint.key) == ("prefix_hit", holder.key)
    assert decision.matched_fraction == pytest.approx(8 / 10)
    assert policy.index_sizes() == {holder.key: 8}
    assert policy.index_bytes() > 0
    policy.forget(holder.key)
    assert policy.index_sizes() == {}
    assert policy.pick(turn2, fleet).reason == "cold"


def test_cache_aware_overflows_when_the_holder_is_over_the_bound() -> None:
    policy = build_policy("cache-aware", CONFIG)
    req = request(prompt("hot"))
    fleet = idle_fleet()
    holder = fleet.get(home_of(req, fleet))
    policy.record(req, holder)
    decision = policy.pick(req, idle_fleet(loads={holder.key: 6}))
    assert (decision.reason, decision.moved_by) == ("overflow", "bounded-load")  # a hot spot, by in-flight load
    assert decision.endpoint.key == rendezvous_order(placement_key(req, CONFIG.affinity_blocks), fleet.endpoints)[1].key
    below_one = CacheAwarePolicy(RoutingConfig(load_bound=0.5, hot_spot_bound=0.5, load_slack=0))
    for key in KEYS[:4] * 20:  # twenty recent requests each: every share is over half the mean
        below_one.record(request(prompt(f"other-{key}")), state(key))
    assert below_one.pick(req, idle_fleet(KEYS[:4], {k: 2 for k in KEYS[:4]})).reason == "fallback"


def test_a_system_prompt_cached_everywhere_does_not_pull_new_prompts_to_one_replica() -> None:
    policy = build_policy("cache-aware", CONFIG)
    fleet = idle_fleet(KEYS[:4])
    system = prompt("you are a helpful assistant", blocks=10)
    for endpoint in fleet.endpoints:
        policy.record(request(system), endpoint)
    placed = Counter()
    for i in range(200):
        new = request(system + prompt(f"user-{i}", blocks=2))
        decision = policy.pick(new, fleet)
        policy.record(new, decision.endpoint)
        assert decision.reason == "cold"
        placed[decision.endpoint.key] += 1
    assert min(placed[key] for key in KEYS[:4]) > 25


def simulate(policy: Policy, requests: list[RequestInfo], keys: list[str], window: int) -> list[tuple[str, str]]:
    """Pick and record each request with the loads it leaves; the oldest finishes once `window` are open."""
    in_flight: Counter[str] = Counter()
    open_requests: deque[str] = deque()
    choices = []
    for req in requests:
        if len(open_requests) >= window:
            in_flight[open_requests.popleft()] -= 1
        decision = policy.pick(req, idle_fleet(keys, in_flight))
        policy.record(req, decision.endpoint)
        in_flight[decision.endpoint.key] += 1
        open_requests.append(decision.endpoint.key)
        assert within_bound(policy.name, in_flight, keys)
        choices.append((decision.endpoint.key, decision.reason))
    return choices


def mixed_traffic(seed: int, count: int) -> list[RequestInfo]:
    rng = random.Random(seed)
    tenants = [prompt(f"tenant-{i}", blocks=12) for i in range(20)]
    return [request(rng.choice(tenants) + prompt(f"q{rng.random()}", blocks=2)) for _ in range(count)]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_two_instances_fed_the_same_sequence_choose_identically(name: str) -> None:
    requests = mixed_traffic(seed=11, count=300)
    first = simulate(build_policy(name, CONFIG), requests, KEYS, window=24)
    second = simulate(build_policy(name, CONFIG), requests, KEYS, window=24)
    assert first == second
    assert len({key for key, _ in first}) > len(KEYS) // 2  # 20 tenants spread, not piled on a few replicas


def test_cache_aware_keeps_tenants_on_few_replicas_within_the_load_bound() -> None:
    choices = simulate(build_policy("cache-aware", CONFIG), mixed_traffic(seed=5, count=600), KEYS, window=16)
    assert Counter(reason for _, reason in choices)["prefix_hit"] > 400


@pytest.mark.parametrize("name", ["prefix-hash", "cache-aware"])
def test_a_joining_or_leaving_replica_moves_only_its_share_of_prefixes(name: str) -> None:
    requests = [request(prompt(f"key-{i}")) for i in range(2000)]

    def placements(keys: list[str]) -> list[str]:
        policy = build_policy(name, CONFIG)  # fresh: every placement is a cold one
        return [policy.pick(req, idle_fleet(keys)).endpoint.key for req in requests]

    ten = [f"pod-{i}" for i in range(10)]
    before, joined, left = placements(ten), placements(ten + ["pod-new"]), placements(ten[1:])
    moved_on_join = [(a, b) for a, b in zip(before, joined) if a != b]
    assert all(b == "pod-new" for _, b in moved_on_join)
    assert 0.05 < len(moved_on_join) / len(requests) < 0.14  # about 1/11
    moved_on_leave = [(a, b) for a, b in zip(before, left) if a != b]
    assert all(a == "pod-0" for a, _ in moved_on_leave)
    assert len(moved_on_leave) == before.count("pod-0")


@pytest.mark.parametrize("name", ["prefix-hash", "cache-aware"])
def test_a_hot_prefix_burst_stays_bounded_and_spills_along_its_rendezvous_order(name: str) -> None:
    policy = build_policy(name, CONFIG)
    hot = request(prompt("viral", blocks=20))
    in_flight = Counter({key: 4 for key in KEYS})  # the fleet is already busy with other work
    served = Counter()
    for _ in range(24):
        fleet = idle_fleet(KEYS, in_flight)
        decision = policy.pick(hot, fleet)
        policy.record(hot, decision.endpoint)
        in_flight[decision.endpoint.key] += 1
        served[decision.endpoint.key] += 1
        assert within_bound(name, in_flight, KEYS)
    order = [s.key for s in rendezvous_order(placement_key(hot, CONFIG.affinity_blocks), idle_fleet().endpoints)]
    assert set(served) == set(order[: len(served)])  # the next replicas in the prefix's order, no others
    assert len(served) <= 5
    sprayed = Counter()
    least_load = build_policy("least-load", CONFIG)
    in_flight = Counter({key: 4 for key in KEYS})
    for _ in range(24):
        chosen = least_load.pick(hot, idle_fleet(KEYS, in_flight)).endpoint.key
        in_flight[chosen] += 1
        sprayed[chosen] += 1
    assert len(sprayed) == len(KEYS)  # what a load-only policy does with the same burst


def test_load_slack_keeps_low_loads_home_and_leaves_high_loads_to_the_bound() -> None:
    cycle = cycle_for(request("x"))
    # Mean about 2: 1.25x the mean is within one request of it; a slack of 2 lets a replica hold 4 first.
    low = [state("a", 3), state("b", 2), state("c", 1)]
    assert [s.key for s in BoundedLoadFilter(1.25).filter(cycle, low)] == ["b", "c"]
    assert [s.key for s in BoundedLoadFilter(1.25, slack=2).filter(cycle, low)] == ["a", "b", "c"]
    assert [s.key for s in BoundedLoadFilter(1.25, slack=2).filter(cycle, [state("a", 5), *low[1:]])] == ["b", "c"]
    # Mean about 20: 1.25x the mean (25 or 26) is looser than mean + 2 (22 or 23), so the bound alone decides.
    high = [state("a", 26), state("b", 20), state("c", 14)]
    assert [s.key for s in BoundedLoadFilter(1.25, slack=2).filter(cycle, high)] == ["b", "c"]
    assert [s.key for s in BoundedLoadFilter(1.25, slack=2).filter(cycle, [state("a", 24), *high[1:]])] == \
        ["a", "b", "c"]


def test_cost_is_uncached_prefill_plus_queueing_in_seconds() -> None:
    config = RoutingConfig(prefill_tokens_per_second=1000.0, queue_seconds_per_request=0.1)
    cost = RequestCost(config)
    req = request(prompt("a", blocks=10))  # 640 characters: 160 tokens
    assert prompt_tokens(req, config) == 160
    assert prompt_tokens(dataclasses.replace(req, token_ids=tuple(range(37))), config) == 37  # tokenized: counted
    assert cost.seconds(req, {"a": 100}, state("a")) == pytest.approx(0.060)
    # Elsewhere it also stores again the 100 tokens "a" holds, evicting as many that others will prefill again.
    assert cost.seconds(req, {"a": 100}, state("b")) == pytest.approx(0.160 + 0.100)
    assert cost.seconds(req, {}, state("b", in_flight=5)) == pytest.approx(0.160)  # running, seats free: no wait
    # A fresh scrape showing a queue: every seat is taken, so it waits behind the queue and one more.
    assert cost.seconds(req, {}, state("c", waiting=3, running=8, stale=False, scraped_at=1.0)) == \
        pytest.approx(0.160 + 0.4)
    # Its uncached tokens do not fit in the free KV cache: it waits for blocks as for a seat.
    full = state("d", kv_cache_usage=0.99, block_size=16, num_gpu_blocks=100, stale=False, scraped_at=1.0)
    assert cost.seconds(req, {}, full) == pytest.approx(0.160 + 0.1)


def test_a_replica_a_few_requests_over_the_mean_keeps_the_conversation_it_caches() -> None:
    policy = build_policy("cache-aware", CONFIG)
    turn1 = tenant_chat("t", prompt("first question", 30))
    fleet = idle_fleet(KEYS[:3])
    holder = policy.pick(turn1, fleet).endpoint
    policy.record(turn1, holder)
    turn2 = tenant_chat("t", prompt("first question", 30) + "and a follow-up")
    # 7 in flight against 3 elsewhere: over the bounded-load cap, far from a hot spot.
    busy = idle_fleet(KEYS[:3], {key: 7 if key == holder.key else 3 for key in KEYS[:3]})
    assert BoundedLoadFilter(CONFIG.load_bound).filter(cycle_for(turn2), busy.endpoints) != busy.endpoints
    decision = policy.pick(turn2, busy)
    assert (decision.reason, decision.endpoint.key) == ("prefix_hit", holder.key)
    # A new tenant goes where the fewest requests went lately; to a gateway that knows of part of the traffic, its
    # home is that replica, and the tenant is placed under the bound instead.
    newcomer = next(req for i in range(100) if rendezvous_order(
        placement_key(req := tenant_chat(f"u{i}", "hi"), req.anchor_blocks), busy.endpoints)[0].key == holder.key)
    decision = policy.pick(newcomer, busy)
    assert decision.reason == "cold" and decision.endpoint.key != holder.key
    decision = policy.pick(newcomer, dataclasses.replace(busy, partial_view=True))
    assert decision.reason == "overflow" and decision.endpoint.key != holder.key


def test_a_queue_on_the_holder_moves_a_request_once_waiting_costs_more_than_prefilling_it_twice() -> None:
    config = RoutingConfig(prefill_tokens_per_second=1000.0, queue_seconds_per_request=0.05)
    policy = CacheAwarePolicy(config)
    req = request(prompt("context", blocks=10))  # 160 tokens: 0.16 s of prefill elsewhere, 0.16 s of evictions
    holder = idle_fleet(KEYS[:2]).endpoints[0]
    policy.record(req, holder)

    def with_queue(waiting: int) -> FleetSnapshot:
        return fleet_of(state(holder.key, waiting=waiting, running=4, stale=False, scraped_at=1.0), state(KEYS[1]))

    assert policy.pick(req, with_queue(1)).endpoint.key == holder.key  # 2 x 0.05 s < 0.32 s
    kept = policy.pick(req, with_queue(5))  # 6 x 0.05 s < 0.32 s
    assert (kept.endpoint.key, kept.moved_by) == (holder.key, "")
    decision = policy.pick(req, with_queue(6))  # 7 x 0.05 s > 0.32 s
    assert (decision.reason, decision.endpoint.key, decision.moved_by) == ("overflow", KEYS[1], "cost")


@pytest.mark.parametrize("waiting", [1, 6])
def test_a_queue_behind_a_full_kv_cache_is_waited_behind_first_come_first_served(waiting: int) -> None:
    # vLLM admits its queue in order and stops at the first request it cannot give blocks: a request whose
    # uncached tokens would fit still waits behind the whole queue, as behind a queue for seats.
    config = RoutingConfig(prefill_tokens_per_second=1000.0, queue_seconds_per_request=0.05)
    policy = CacheAwarePolicy(config)
    req = request(prompt("context", blocks=10))  # 160 tokens: 0.32 s elsewhere, its evictions included
    holder = idle_fleet(KEYS[:2]).endpoints[0]
    policy.record(req, holder)
    full = state(holder.key, waiting=waiting, running=4, kv_cache_usage=0.95, block_size=16, num_gpu_blocks=1000,
                 stale=False, scraped_at=1.0)  # 800 free tokens: the request's own would fit
    assert RequestCost(config).seconds(req, {holder.key: 160}, full) == pytest.approx((waiting + 1) * 0.05)
    decision = policy.pick(req, fleet_of(full, state(KEYS[1])))
    assert decision.endpoint.key == (holder.key if waiting == 1 else KEYS[1])  # 2 x 0.05 s < 0.32 s < 7 x 0.05 s


def test_matched_tokens_from_any_index_rank_the_same_way() -> None:
    picker = LowestCostPicker(RequestCost(CONFIG))
    req = request(prompt("a", blocks=20))
    candidates = [state(key) for key in KEYS[:3]]
    cycle = Cycle(req, placement_key(req, CONFIG.affinity_blocks), {KEYS[2]: 300, KEYS[1]: 100})
    assert [s.key for s in picker.rank(cycle, candidates)] == [KEYS[2], KEYS[1], KEYS[0]]


def test_holders_are_the_replicas_holding_more_of_a_prompt_than_the_least() -> None:
    policy = build_policy("cache-aware", CONFIG)
    candidates = [state(key) for key in KEYS[:3]]
    req = request(prompt("a", blocks=20))
    assert policy.holders(req, candidates, 0.0) == frozenset()  # nobody holds it
    policy.record(req, candidates[1])
    assert policy.holders(req, candidates, 0.0) == {KEYS[1]}
    for other in candidates:
        policy.record(req, other)
    assert policy.holders(req, candidates, 0.0) == frozenset()  # held everywhere: nowhere more than the least
    assert build_policy("round-robin", CONFIG).holders(req, candidates, 0.0) == frozenset()  # no index


def test_balance_window_keeps_share_noise_well_inside_the_bound() -> None:
    assert balance_window(3, 1.25) == 288
    assert balance_window(8, 1.25) == 1008
    assert balance_window(1, 1.25) >= 1


def test_placement_spills_a_replica_whose_recent_share_is_over_the_bound_not_one_busy_for_an_instant() -> None:
    keys = KEYS[:3]
    policy = build_policy("cache-aware", CONFIG)
    newcomer = next(req for i in range(100) if rendezvous_order(
        placement_key(req := tenant_chat(f"n{i}", "hi"), req.anchor_blocks), idle_fleet(keys).endpoints)[0].key == keys[0])
    # An instant burst on its home (in flight 5 against 1 and 1) is noise: the tenant still goes home.
    burst = idle_fleet(keys, {keys[0]: 5, keys[1]: 1, keys[2]: 1}, partial_view=True)
    assert (policy.pick(newcomer, burst).reason, policy.pick(newcomer, burst).endpoint.key) == ("cold", keys[0])
    # Half of the last few hundred requests went there: a hot spot under skew, so new context goes elsewhere.
    for i in range(300):
        policy.record(request(prompt(f"r{i}")), idle_fleet(keys).endpoints[0 if i % 2 else 1 + i % 4 // 2])
    decision = policy.pick(newcomer, idle_fleet(keys, partial_view=True))
    assert decision.reason == "overflow" and decision.endpoint.key != keys[0]
    assert decision.moved_by == "recent-share"


def test_the_hot_spot_bound_ignores_poisson_noise_at_low_load_but_not_a_pile_up() -> None:
    cycle = cycle_for(request("x"))
    hot_spot = BoundedLoadFilter(CONFIG.hot_spot_bound, CONFIG.load_slack, noise_sigmas=NOISE_SIGMAS)
    burst = [state("a", 5), state("b", 1), state("c", 1)]  # about one in flight each, five by chance
    assert len(hot_spot.filter(cycle, burst)) == 3
    pile_up = [state("a", 20), state("b", 2), state("c", 2)]
    assert [s.key for s in hot_spot.filter(cycle, pile_up)] == ["b", "c"]


def chat_of(*turns: str, system: str | None = None) -> RequestInfo:
    roles = ("user", "assistant")
    messages = [{"role": roles[position % 2], "content": text} for position, text in enumerate(turns)]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return build_request_info("chat", {"model": "m", "messages": messages}, "interactive", CONFIG)


@pytest.mark.parametrize("blocks", [2, 5, 12])  # a first message shorter than, about, and longer than the affinity
def test_a_conversation_without_a_system_prompt_stays_where_its_first_turn_went(blocks: int) -> None:
    fleet = idle_fleet(KEYS[:3], partial_view=True)  # gateways that do not share their decisions
    gateway, other_gateway = build_policy("cache-aware", CONFIG), build_policy("cache-aware", CONFIG)
    placed_home = 0
    for i in range(30):
        question = prompt(f"question {i}", blocks)
        turn1 = chat_of(question)
        decision = gateway.pick(turn1, fleet)
        gateway.record(turn1, decision.endpoint)
        turn2 = chat_of(question, prompt("an answer", 6), "a follow-up")
        assert gateway.pick(turn2, fleet).endpoint.key == decision.endpoint.key  # its first turn is cached there
        if decision.reason == "cold":  # placed at its home, not spilled by this gateway's own counts
            placed_home += 1
            assert other_gateway.pick(turn2, fleet).endpoint == decision.endpoint  # one that never saw turn 1 agrees
    assert placed_home >= 20


def precise_fleet() -> tuple[FleetSnapshot, PrecisePrefixIndex]:
    """Three replicas of 16-token blocks whose KV events flow."""
    index = PrecisePrefixIndex(hold_s=30.0)
    for key in KEYS[:3]:
        index.set_precise(key, True)
    return fleet_of(*(state(key, block_size=16) for key in KEYS[:3])), index


def tokenized_tenant_chat(question: str, anchor_ids: tuple[int, ...]) -> RequestInfo:
    """A new conversation of tenant one, tokenized as its engine does."""
    body = {"model": "m", "messages": [{"role": "system", "content": "Answer as tenant one's assistant. " * 20},
                                       {"role": "user", "content": question}]}
    info = build_request_info("chat", body, "interactive", CONFIG)
    return dataclasses.replace(info, token_ids=anchor_ids + tuple(range(len(question))), anchor_tokens=len(anchor_ids))


@pytest.mark.parametrize("chars_per_token", [1.0, 4.0, 16.0])  # the estimate over, near and under the truth
def test_a_replica_holding_a_tenants_system_prompt_keeps_its_new_conversations_over_the_share_bound(
        chars_per_token: float) -> None:
    config = dataclasses.replace(CONFIG, chars_per_token=chars_per_token)
    anchor_ids = tuple(range(1000, 1400))  # 400 tokens: what the engine's tokenizer makes of the system prompt
    snapshot, index = precise_fleet()
    policy = CacheAwarePolicy(config, index)
    holder = snapshot.endpoints[1]
    index.match_tokens([(holder.key, 16)], anchor_ids, "m", None, now=0.0)
    index.hold(holder.key, 16, anchor_ids, "m", None)  # the holder stores the system prompt
    for n in range(40):  # and takes every recent request: over the share bound, but no hot spot (nothing in flight)
        other = request(prompt(f"other {n}"))
        policy.pick(other, snapshot)
        policy.record(other, holder)
    decision = policy.pick(tokenized_tenant_chat("a new conversation", anchor_ids), snapshot)
    assert decision.endpoint.key == holder.key and decision.reason == "prefix_hit"
    hot = fleet_of(*(dataclasses.replace(s, in_flight=30 if s.key == holder.key else 0) for s in snapshot.endpoints))
    assert policy.pick(tokenized_tenant_chat("another one", anchor_ids), hot).endpoint.key != holder.key


def test_a_mixed_fleet_weighs_believed_blocks_at_the_requests_own_characters_per_token() -> None:
    """Where the engine's tokens are shorter than the configured estimate, a replica believed to hold more of the
    prompt's text than another's events show holds more tokens too."""
    snapshot, index = precise_fleet()
    index.set_precise(KEYS[1], False)  # no events from this one: routed on the approximate index
    text = "half a token a character, " * 40
    ids = tuple(range(2000, 2000 + len(text) // 2))  # two characters a token
    info = dataclasses.replace(build_request_info("completion", {"model": "m", "prompt": text}, "interactive", CONFIG),
                               token_ids=ids)
    policy = CacheAwarePolicy(CONFIG, index)
    earlier = build_request_info("completion", {"model": "m", "prompt": text[:640]}, "interactive", CONFIG)
    policy.record(earlier, snapshot.endpoints[1])  # believed: the first 640 characters, 320 tokens
    index.match_tokens([(KEYS[0], 16)], ids, "m", None, now=0.0)
    index.hold(KEYS[0], 16, ids[:288], "m", None)  # its events: the first 288 tokens
    matched, _ = policy.matched_tokens(info, snapshot.endpoints)
    assert matched[KEYS[1]] == 320 and matched[KEYS[0]] == 288
    assert policy.pick(info, snapshot).endpoint.key == KEYS[1]
