"""Tenant placement: busy placement keys packed onto replicas alike on every gateway, whole and evenly."""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest

from kvgate.endpoints.types import Endpoint, EndpointState, FleetSnapshot
from kvgate.policies import RoutingConfig, build_policy, build_request_info
from kvgate.policies.balance import balance_window
from kvgate.policies.rendezvous import rendezvous_order
from kvgate.policies.tenants import TenantPlacement, assign, coarse_weights

REPLICAS = ["pod-a", "pod-b", "pod-c"]
CONFIG = RoutingConfig()
WINDOW = balance_window(len(REPLICAS), CONFIG.load_bound)


def fleet(keys: list[str] = REPLICAS, partial_view: bool = False) -> FleetSnapshot:
    """Idle replicas; `partial_view`: as a gateway that knows of part of their traffic sees them."""
    return FleetSnapshot(tuple(EndpointState(Endpoint(key, f"http://{key}:8000")) for key in keys),
                         partial_view=partial_view)


def zipf_stream(tenants: int, count: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / rank**s for rank in range(1, tenants + 1)]
    return rng.choices(range(1000, 1000 + tenants), weights, k=count)


def test_noise_leaves_every_ordinary_tenant_at_one_and_a_hot_one_weighs_a_power_of_two() -> None:
    rng = random.Random(3)
    noisy = {key: rng.gauss(12.0, 3.0) for key in range(24)}
    assert set(coarse_weights(noisy).values()) == {1}
    weights = coarse_weights({1: 95.0, 2: 40.0, **{key: 10.0 for key in range(10, 30)}})
    assert weights[1] == 8  # 9.5x the mean light key, rounded to a half power of two
    assert weights[2] == 4  # 4x: heavy once the first is taken out of the unit
    assert {weights[key] for key in range(10, 30)} == {1}
    assert coarse_weights({}) == {}


def test_a_tenant_near_a_weight_boundary_keeps_its_weight_until_clearly_past_it() -> None:
    ordinary = {key: 10.0 for key in range(10, 30)}

    def weight(count: float, previous: float | None) -> float:
        return coarse_weights({1: count, **ordinary}, {} if previous is None else {1: previous})[1]

    assert weight(24.0, None) == weight(30.0, 1) == 1  # 2.4x and 2.7x the unit: not yet clearly heavy
    assert weight(35.0, None) == weight(35.0, 1) == 4  # 3.5x: clearly heavy, the nearest half power of two
    assert weight(17.0, 2) == 2  # 1.7x: back under twice the unit, a heavy key stays heavy
    assert weight(13.0, 2) == 1  # 1.3x: clearly light


def test_skewed_popularity_is_weighed_by_the_light_keys_not_the_mean_of_all() -> None:
    counts = {0: 100.0, 1: 48.0, **{key: 4.0 for key in range(10, 48)}}  # two heavy tenants, 38 light ones
    weights = coarse_weights(counts)
    assert weights[0] == 2**4.5 and weights[1] == 2**3.5  # 25x and 12x the light key
    share = {key: weights[key] / sum(weights.values()) for key in (0, 1)}
    assert abs(share[0] - 100 / 300) < 0.05 and abs(share[1] - 48 / 300) < 0.03  # a true share of the load
    homes = assign(weights, REPLICAS)
    assert homes[0] != homes[1]  # the two heavy tenants never share a home
    load = Counter()
    for key, home in homes.items():
        load[home] += counts[key] / 300
    assert max(load.values()) < 0.38  # the busiest home carries little more than its heavy tenant's third


def test_equal_tenants_are_packed_evenly_and_the_map_does_not_depend_on_order() -> None:
    weights = dict.fromkeys(range(24), 1)
    homes = assign(weights, REPLICAS)
    assert sorted(Counter(homes.values()).values()) == [8, 8, 8]
    assert assign(dict(reversed(weights.items())), list(reversed(REPLICAS))) == homes
    rendezvous = {key: rendezvous_order(key, fleet().endpoints)[0].key for key in weights}
    assert sum(homes[key] == rendezvous[key] for key in weights) >= 20  # only the excess moves


def test_a_tenant_hotter_than_a_fair_share_gets_its_home_and_the_rest_fill_around_it() -> None:
    weights = {7: 16, **dict.fromkeys(range(100, 124), 1)}  # one tenant as busy as 16 ordinary ones
    homes = assign(weights, REPLICAS)
    hot_home = homes[7]
    assert hot_home == rendezvous_order(7, fleet().endpoints)[0].key
    load = Counter()
    for key, home in homes.items():
        load[home] += weights[key]
    assert load[hot_home] == 16  # nobody else joins it
    assert all(11 <= load[replica] <= 14 for replica in REPLICAS if replica != hot_home)  # 40 / 3 each, about


def test_a_key_seen_once_has_no_home_and_busy_keys_do() -> None:
    placement = TenantPlacement()
    candidates = fleet().endpoints
    placement.observe(1, WINDOW)
    assert placement.home(1, candidates) is None
    for _ in range(40):
        placement.observe(2, WINDOW)
    placement.observe(2, WINDOW)
    assert placement.home(2, candidates) in REPLICAS
    assert placement.home(1, candidates) is None
    # A replica leaving moves the map at once.
    two = fleet(REPLICAS[:2]).endpoints
    assert placement.home(2, two) in REPLICAS[:2]


def test_two_gateways_seeing_alternate_requests_send_the_same_tenants_to_the_same_homes() -> None:
    candidates = fleet().endpoints
    for tenants, skew, floor in ((24, 0.0, 0.97), (150, 0.0, 0.9), (24, 1.2, 0.85), (60, 1.2, 0.85)):
        stream = zipf_stream(tenants, 2000, skew, seed=1)
        requests = Counter(stream)
        gateways = [TenantPlacement(), TenantPlacement()]
        agreed = total = 0
        for position, key in enumerate(stream):
            gateways[position % 2].observe(key, WINDOW)
            if position >= 600 and position % 50 == 0:
                homes = [{key: gateway.home(key, candidates) or rendezvous_order(key, candidates)[0].key
                          for key in requests} for gateway in gateways]
                agreed += sum(count for key, count in requests.items() if homes[0][key] == homes[1][key])
                total += sum(requests.values())
        assert agreed / total >= floor, (tenants, skew, agreed / total)  # weighed by the tenants' requests


def chat(tenant: int, *turns: str) -> object:
    """A chat of `tenant`: its system prompt, then the user turns given, each but the last answered."""
    messages = [{"role": "system", "content": (f"tenant {tenant} system prompt " * 80)[:1600]}]
    for number, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        if number < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"The answer to {user!r} is in the handbook, section 4."})
    return build_request_info("chat", {"model": "m", "messages": messages}, "interactive", CONFIG)


@pytest.mark.parametrize("partial_view", [False, True])  # placed by the fleet's history, or by the tenant map
def test_new_conversations_follow_their_tenants_home_not_a_shared_opening_words_block(partial_view: bool) -> None:
    policy = build_policy("cache-aware", CONFIG)
    idle = fleet(partial_view=partial_view)
    placed: dict[int, set[str]] = {}
    for turn in range(400):
        tenant = turn % 24
        request = chat(tenant, f"Question 1: what about item {turn}?")
        decision = policy.pick(request, idle)
        policy.record(request, decision.endpoint)
        if turn >= 200:
            placed.setdefault(tenant, set()).add(decision.endpoint.key)
    assert all(len(homes) == 1 for homes in placed.values())  # each tenant whole on one replica
    assert sorted(Counter(next(iter(homes)) for homes in placed.values()).values()) == [8, 8, 8]


def test_a_later_turn_another_gateway_placed_stays_at_its_tenants_home_past_the_share_bound() -> None:
    policy = build_policy("cache-aware", CONFIG)
    idle = fleet(partial_view=True)  # the other gateway does not share its decisions
    placed: Counter[str] = Counter()
    for number in range(600):  # tenant 0 brings two thirds of the traffic: more than its home's share bound allows
        tenant = 0 if number % 3 else number % 24
        request = chat(tenant, f"Question 1: what about item {number}?")
        decision = policy.pick(request, idle)
        policy.record(request, decision.endpoint)
        if tenant == 0 and number >= 300:
            placed[decision.endpoint.key] += 1
    home = placed.most_common(1)[0][0]
    spilled = policy.pick(chat(0, "Question 1: what about the warranty?"), idle)
    assert spilled.endpoint.key != home and spilled.reason == "overflow"  # a new conversation: the bound holds
    # Turn 3 of a conversation whose first two turns another gateway placed: new to this gateway's index.
    later = chat(0, "Question 1: what about the refund?", "Question 2: and the invoice?", "Question 3: when?")
    decision = policy.pick(later, idle)
    assert decision.endpoint.key == home and decision.reason == "prefix_hit"


def test_a_gateway_that_knows_every_request_places_each_tenant_evenly_from_its_first_and_never_moves_it() -> None:
    policy = build_policy("cache-aware", CONFIG)
    idle = fleet()
    first: dict[int, str] = {}
    for number in range(240):  # 24 tenants' conversations, each tenant's first one among the first 24 requests
        tenant = number % 24
        request = chat(tenant, f"Question 1: what about item {number}?")
        decision = policy.pick(request, idle)
        policy.record(request, decision.endpoint)
        assert first.setdefault(tenant, decision.endpoint.key) == decision.endpoint.key  # never moved
    assert sorted(Counter(first.values()).values()) == [8, 8, 8]
    # By rendezvous alone (all a gateway knowing of part of the traffic has before its tenant map fills), the same
    # tenants' first conversations land unevenly.
    alone = build_policy("cache-aware", CONFIG)
    by_key = Counter(alone.pick(chat(tenant, "Question 1: hello?"), fleet(partial_view=True)).endpoint.key
                     for tenant in range(24))
    assert sorted(by_key.values()) != [8, 8, 8]


def test_gateways_sharing_their_decisions_send_each_new_tenant_to_the_same_replica() -> None:
    gateways = [build_policy("cache-aware", CONFIG), build_policy("cache-aware", CONFIG)]
    idle = fleet()
    rng = random.Random(7)
    for number in range(360):
        # A tenant new to the fleet every sixth request, the rest from those already seen: new tenants keep coming
        # after the tenants' weights (and the requests pledged for each new one) are in play.
        tenant = number // 6 if number % 6 == 0 else rng.randrange(number // 6 + 1)
        request = chat(tenant, f"Question 1: what about item {number}?")
        deciding, learning = rng.sample(gateways, 2)  # a front that spreads requests at random
        chosen = deciding.pick(request, idle).endpoint
        # What the other gateway would have chosen, asked of a copy: picking counts the request.
        assert copy.deepcopy(learning).pick(request, idle).endpoint == chosen
        deciding.record(request, chosen)
        learning.learn(request, chosen, idle)


def test_new_tenants_arriving_together_spread_instead_of_all_following_the_quietest_replica() -> None:
    policy = build_policy("cache-aware", CONFIG)
    idle = fleet()

    def route(request: object) -> str:
        decision = policy.pick(request, idle)
        policy.record(request, decision.endpoint)
        return decision.endpoint.key

    homes = {tenant: route(chat(tenant, "Question 1: hello?")) for tenant in range(12)}
    quiet = homes[0]
    for number in range(240):  # every tenant is busy but those at one replica, which falls far behind on requests
        tenant = [tenant for tenant, home in homes.items() if home != quiet][number % 8]
        route(chat(tenant, f"Question 1: what about item {number}?"))
    arrivals = Counter(route(chat(100 + tenant, "Question 1: hello?")) for tenant in range(6))
    # The quiet replica is about 24 requests behind, so by request counts alone all six would go there. Each new
    # tenant is counted instead as the requests a typical tenant brings: the quiet replica takes its shortfall's
    # worth, and the rest spread.
    assert max(arrivals.values()) <= 3 and len(arrivals) == 3
