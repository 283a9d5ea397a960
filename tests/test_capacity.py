"""The capacity model as plain data: a class's standing, room for it, retry order, the seat a preemption frees."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from kvgate.endpoints.types import Endpoint, EndpointState, ReplicaMetrics
from kvgate.policies.capacity import (ClassStanding, PromptTokens, SaturationThresholds, SeatLearner, first_to_fill,
                                      kv_room, kv_seats, kv_slots, kv_usage, occupied, peer_seats, room_for,
                                      seat_to_free, with_room)
from kvgate.policies.cost import requests_ahead
from kvgate.policies.rendezvous import retry_order


def replica(key: str, seats: int | None, running: int = 0, waiting: int = 0, in_flight: int = 0) -> EndpointState:
    metrics = ReplicaMetrics(running=running, waiting=waiting, scraped_at=1.0, stale=False)
    return EndpointState(Endpoint(key, f"http://{key}:8000"), metrics=metrics, seats=seats, in_flight=in_flight)


@dataclass(frozen=True)
class Holder:
    seq: int


def test_a_reserve_is_kept_only_while_a_more_important_class_is_active_and_never_by_a_preemptible_request() -> None:
    fleet = [replica("a", seats=4, running=2), replica("b", seats=4, running=2)]  # 4 seats free of 8
    limits = SaturationThresholds()
    assert room_for(fleet, limits, ClassStanding(reserve=0.5)) == 4 + 2  # alone: every free seat, one probe each
    assert room_for(fleet, limits, ClassStanding(reserve=0.5, yields=True)) == 0  # 4 of 8 seats kept free
    assert room_for(fleet, limits, ClassStanding(reserve=0.5, yields=True, preemptible=True)) == 4
    assert room_for(fleet, limits, ClassStanding(may_preempt=True)) == 4  # a seat, never a place in a queue


def test_no_candidate_means_no_wait() -> None:
    assert room_for([], SaturationThresholds(), ClassStanding(yields=True)) == float("inf")


def test_a_full_kv_cache_leaves_no_room_whatever_the_seats() -> None:
    full = EndpointState(Endpoint("a", "http://a:8000"), seats=8,
                         metrics=ReplicaMetrics(running=1, kv_cache_usage=0.9, scraped_at=1.0, stale=False))
    assert room_for([full], SaturationThresholds(kv_cache=0.8), ClassStanding()) == 0
    brim = dataclasses.replace(full, metrics=dataclasses.replace(full.metrics, kv_cache_usage=1.0))
    assert room_for([brim], SaturationThresholds(kv_cache=1.0), ClassStanding()) == 5  # 1.0: only the queue bound holds


def test_a_full_kv_cache_has_room_for_a_class_among_others_once_a_request_it_ran_finished_since_the_scrape() -> None:
    # 4 running hold 0.9 of the cache; one finished since the scrape freed about a quarter of that. A class alone
    # waits for the next scrape instead, which shows every replica's room.
    def scraped_full(recent: int) -> EndpointState:
        metrics = ReplicaMetrics(running=4, kv_cache_usage=0.9, scraped_at=1.0, stale=False)
        return EndpointState(Endpoint("a", "http://a:8000"), seats=8, metrics=metrics, recent=recent)

    limits = SaturationThresholds(kv_cache=0.8)
    assert kv_usage(scraped_full(0)) == 0.9
    assert kv_usage(scraped_full(-1)) == 0.9 * 3 / 4
    assert kv_usage(scraped_full(2)) == 0.9  # sent since: the queue and seat estimates count them
    # Where the cache size is known, what it holds beyond the page is counted as the engine counts it.
    sized = ReplicaMetrics(running=4, kv_cache_usage=0.8, block_size=16, num_gpu_blocks=500, scraped_at=1.0,
                           stale=False)
    assert kv_usage(EndpointState(Endpoint("a", "http://a:8000"), metrics=sized, kv_grown=800)) == pytest.approx(0.9)
    assert kv_usage(EndpointState(Endpoint("a", "http://a:8000"), metrics=sized, kv_grown=-80)) == pytest.approx(0.79)
    among_others = ClassStanding(alone=False)
    assert room_for([scraped_full(0)], limits, among_others) == 0
    assert room_for([scraped_full(-1)], limits, among_others) >= 1
    assert room_for([scraped_full(-1)], limits, ClassStanding()) == 0


def test_seats_learned_under_a_full_kv_cache_are_not_seats() -> None:
    learner = SeatLearner(kv_full=0.8)
    for _ in range(3):
        assert learner.observe("a", ReplicaMetrics(running=3, waiting=2, kv_cache_usage=0.95)) is None
    assert learner.seats("a") is None
    learner.observe("a", ReplicaMetrics(running=5, waiting=1, kv_cache_usage=0.5))
    assert learner.observe("a", ReplicaMetrics(running=6, waiting=1, kv_cache_usage=0.5)) is None  # still filling
    assert learner.observe("a", ReplicaMetrics(running=6, waiting=2, kv_cache_usage=0.5)) == 6
    learner.forget("a")
    assert learner.seats("a") is None


def test_a_queue_seen_twice_within_one_engine_step_teaches_no_seats() -> None:
    # vLLM's gauges change once per engine step: two scrapes during one long step (a burst's prefill) read the
    # same page, whose queue says nothing about seats yet.
    learner = SeatLearner(kv_full=0.8)
    page = ReplicaMetrics(running=7, waiting=6, kv_cache_usage=0.05, engine_steps=40)
    for _ in range(3):
        assert learner.observe("a", page) is None
    assert learner.observe("a", ReplicaMetrics(running=7, waiting=4, kv_cache_usage=0.05, engine_steps=41)) == 7
    # an engine that exports no step count is judged on the two scrapes alone
    assert learner.observe("b", ReplicaMetrics(running=5, waiting=1)) is None
    assert learner.observe("b", ReplicaMetrics(running=5, waiting=1)) == 5


def test_the_seat_freed_soonest_is_on_the_replica_needing_fewest_preemptions_then_the_youngest() -> None:
    over = replica("a", seats=2, running=2, waiting=1)  # one beyond its seats: freeing a seat takes two
    full = replica("b", seats=2, running=2)
    victims = {"a": [Holder(1), Holder(5)], "b": [Holder(2), Holder(3)]}
    assert seat_to_free([over, full], victims, {}) == [Holder(3)]
    assert seat_to_free([over], victims, {}) == [Holder(1), Holder(5)]
    assert seat_to_free([over], victims, {"a": 1}) == [Holder(5)]  # one already let go
    assert seat_to_free([replica("c", seats=None, running=2)], {"c": [Holder(4)]}, {}) == []  # seats unknown
    kv_full = EndpointState(Endpoint("d", "http://d:8000"), metrics=ReplicaMetrics(
        running=4, waiting=1, kv_cache_usage=0.81, scraped_at=1.0, stale=False))  # its cache holds four of these
    assert seat_to_free([kv_full], {"d": [Holder(6), Holder(7)]}, {}) == [Holder(6), Holder(7)]


def test_where_a_prompt_does_not_fit_preemption_takes_the_victims_that_free_its_kv_blocks() -> None:
    def cache(key: str, usage: float) -> EndpointState:  # 500 blocks of 16 tokens, 4 seats, all taken
        metrics = ReplicaMetrics(running=4, kv_cache_usage=usage, block_size=16, num_gpu_blocks=500, scraped_at=1.0,
                                 stale=False)
        return EndpointState(Endpoint(key, f"http://{key}:8000"), metrics=metrics, seats=4)

    # "a" has 1,456 tokens free (less a block for each running one to grow), "b" 1,376: a 1,500-token prompt takes
    # 1,520 (its whole blocks and one to grow by), so "a" is 64 short and "b" 144.
    a, b = cache("a", 0.81), cache("b", 0.82)
    victims = {"a": [Holder(1), Holder(2), Holder(9)], "b": [Holder(3), Holder(8)]}
    frees = {1: 1000.0, 2: 300.0, 3: 1000.0, 8: 200.0, 9: 16.0}  # what each frees alone: 9 shares its system prompt

    def freed(key: str, holders: Sequence[Holder]) -> float:
        return sum(frees[holder.seq] for holder in holders)

    assert seat_to_free([a, b], victims, {}) == [Holder(9)]  # by seats alone: the youngest
    # Its 16 tokens leave "a" short of the prompt's blocks. On each replica one victim frees enough: the youngest that
    # does, "a"'s 2 and "b"'s 8, and "b"'s is younger.
    assert seat_to_free([a, b], victims, {}, 1500, freed) == [Holder(8)]
    assert seat_to_free([a, b], victims, {}, 2400, freed) == [Holder(1)]  # only "a"'s oldest frees enough alone
    assert seat_to_free([a, b], victims, {}, 2500, freed) == [Holder(3), Holder(8)]  # two on either: "b"'s younger
    assert seat_to_free([a, b], victims, {}, PromptTokens(2500, {"b": 1200}), freed) == [Holder(8)]  # shared on "b"
    assert seat_to_free([a, b], victims, {}, 4000, freed) == []  # no replica frees that much this way
    assert seat_to_free([a, b], victims, {}, 100, freed) == [Holder(9)]  # it fits: a seat is all it needs


def test_a_request_sent_during_the_engine_step_before_a_scrape_still_counts_as_on_the_replica() -> None:
    # vLLM sets its gauges once per engine step: a scrape that began after a send may not show it yet.
    unseen = replica("a", seats=4, running=3, in_flight=4)  # nothing sent since the scrape, four open
    assert occupied(unseen) == 4
    assert room_for([unseen], SaturationThresholds(), ClassStanding(alone=False)) == 0
    shared = replica("b", seats=8, running=6, in_flight=2)  # the page also counts other gateways' requests
    assert occupied(shared) == 6


def test_a_replica_of_unknown_seats_showing_a_queue_is_full_for_a_request_that_does_not_probe() -> None:
    queued = replica("a", seats=None, running=20, waiting=2)  # every seat it can run now is taken
    limits = SaturationThresholds(queue=5)
    assert room_for([queued], limits, ClassStanding()) == 3  # a class alone: its queue bound, as before
    assert room_for([queued], limits, ClassStanding(alone=False)) == 0  # in a mix it would wait behind that queue
    finished = dataclasses.replace(queued, recent=-3)  # three ended since the scrape: the queue moved up, a seat freed
    assert room_for([finished], limits, ClassStanding(alone=False)) == 1
    victims = {"a": [Holder(1), Holder(2), Holder(3)]}
    assert seat_to_free([queued], victims, {}) == [Holder(1), Holder(2), Holder(3)]  # two queued, then a seat


def test_retries_try_every_candidate_after_the_ranked_ones_least_loaded_first() -> None:
    a, b, c, d = (replica(key, seats=None, in_flight=load) for key, load in (("a", 0), ("b", 9), ("c", 5), ("d", 1)))
    assert [s.key for s in retry_order(7, [a, c], [a, b, c, d])] == ["c", "d", "b"]


def test_a_replica_whose_kv_cache_binds_takes_what_fits_not_what_its_unknown_seats_might() -> None:
    long_prompts = EndpointState(Endpoint("a", "http://a:8000"),
                                 metrics=ReplicaMetrics(running=3, kv_cache_usage=0.6, scraped_at=1.0, stale=False))
    assert kv_slots(long_prompts.metrics, 0.8) == 4  # three sequences hold 60 %: four fit under 80 %
    assert room_for([long_prompts], SaturationThresholds(), ClassStanding(yields=True)) == 4 - 3
    assert room_for([long_prompts], SaturationThresholds(), ClassStanding(reserve=0.25, yields=True)) == 0
    assert room_for([long_prompts], SaturationThresholds(), ClassStanding()) == 5  # alone: its queue bound only
    assert room_for([long_prompts], SaturationThresholds(), ClassStanding(alone=False)) == 5  # the top class fills it


def test_only_a_class_alone_sends_on_the_hope_that_a_replica_of_unknown_seats_has_room() -> None:
    busy = EndpointState(Endpoint("a", "http://a:8000"), recent=3,
                         metrics=ReplicaMetrics(running=20, scraped_at=1.0, stale=False))  # no queue at its scrape
    assert room_for([busy], SaturationThresholds(queue=5), ClassStanding()) == 5  # the three sent since run
    assert room_for([busy], SaturationThresholds(queue=5), ClassStanding(alone=False)) == 2  # they may be waiting


def test_a_class_that_yields_fills_a_replica_of_unknown_seats_by_a_share_of_what_it_runs_per_scrape() -> None:
    # Fifteen running in 6 % of the KV cache: the cache would hold 200, but the seats, unknown, may be 16.
    metrics = ReplicaMetrics(running=15, kv_cache_usage=0.06, scraped_at=1.0, stale=False)
    idle_cache = EndpointState(Endpoint("a", "http://a:8000"), metrics=metrics)
    assert room_for([idle_cache], SaturationThresholds(), ClassStanding(yields=True)) == 2  # a tenth of 15, rounded up
    sent_since = EndpointState(Endpoint("a", "http://a:8000"), metrics=metrics, recent=2, grown=2, in_flight=2)
    assert room_for([sent_since], SaturationThresholds(), ClassStanding(yields=True)) == 0  # grown by a step already
    assert room_for([sent_since], SaturationThresholds(), ClassStanding(alone=False)) == 3  # the top class: its queue
    queued = EndpointState(Endpoint("a", "http://a:8000"), metrics=ReplicaMetrics(running=15, waiting=1,
                                                                                  scraped_at=1.0, stale=False))
    assert room_for([queued], SaturationThresholds(), ClassStanding(yields=True)) == 0


def test_a_class_that_yields_fills_one_replica_of_unknown_seats_at_a_time_until_a_count_is_known() -> None:
    # Three replicas filling in step passed their seats within a second of each other, each with its last growth
    # step waiting inside it, and the interactive requests of that second met those queues wherever they went.
    metrics = ReplicaMetrics(running=20, scraped_at=1.0, stale=False)
    a, b, c = (EndpointState(Endpoint(key, f"http://{key}:8000"), metrics=metrics, in_flight=20) for key in "abc")
    batch, limits = ClassStanding(yields=True), SaturationThresholds()
    assert first_to_fill([c, a, b]) == "a"  # every gateway picks the same
    assert room_for([a, b, c], limits, batch) == 2  # a tenth of what a runs; b and c wait their turn
    assert with_room([a, b, c], limits, batch) == {"a"}
    assert with_room([b], limits, batch) == {"b"}  # asked alone
    assert room_for([a, b, c], limits, ClassStanding(alone=False)) == 3 * 5  # the class above is not held back
    queued = dataclasses.replace(a, metrics=dataclasses.replace(metrics, waiting=2))
    assert first_to_fill([queued, b, c]) == "a"  # a queue seen once: an arrival between two engine steps, perhaps
    queued = dataclasses.replace(queued, filled=True)
    assert first_to_fill([queued, b, c]) == "b"  # full on two scrapes in a row, by its KV cache: the next one fills
    replaced = dataclasses.replace(c, recent=-1, grown=-1, in_flight=19)  # one finished since the scrape
    assert room_for([queued, b, replaced], limits, batch) == 2 + 1  # b's step, and c's finished one replaced
    assert first_to_fill([dataclasses.replace(a, seats=32), b, c]) is None  # a count is known: all grow toward it
    assert first_to_fill([dataclasses.replace(a, metrics=ReplicaMetrics())]) is None  # never scraped: fails open
    stale = dataclasses.replace(a, metrics=dataclasses.replace(metrics, stale=True))
    assert first_to_fill([stale, b, c]) == "b"  # its page cannot be read: it would teach nothing


def test_a_replica_of_unknown_seats_grows_one_at_a_time_past_the_seats_its_peers_showed() -> None:
    # Replicas of one Deployment filling in step would all pass their seats in one scrape, each leaving a tenth of
    # what it runs waiting inside it, first come first served, wherever the next interactive request goes.
    metrics = ReplicaMetrics(running=30, scraped_at=1.0, stale=False)
    alone = EndpointState(Endpoint("b", "http://b:8000"), metrics=metrics)
    assert room_for([alone], SaturationThresholds(), ClassStanding(yields=True)) == 3  # a tenth of 30
    guided = dataclasses.replace(alone, peer_seats=32)
    assert room_for([guided], SaturationThresholds(), ClassStanding(yields=True)) == 2  # up to its peer's 32
    at_them = dataclasses.replace(guided, metrics=dataclasses.replace(metrics, running=32))
    assert room_for([at_them], SaturationThresholds(), ClassStanding(yields=True)) == 1  # one past: it may have more
    bigger = dataclasses.replace(guided, metrics=dataclasses.replace(metrics, running=40))  # no queue at 40 of 32
    assert room_for([bigger], SaturationThresholds(), ClassStanding(yields=True)) == 4  # it has more: a tenth again
    assert room_for([bigger], SaturationThresholds(), ClassStanding(alone=False)) == 0  # and at least 40 seats
    assert room_for([dataclasses.replace(bigger, grown=-2, recent=-2)], SaturationThresholds(),
                    ClassStanding(alone=False)) == 2  # two of its 40 finished since the scrape


def test_a_replica_of_unknown_seats_is_full_at_its_peers_seats_for_a_request_that_would_wait_inside_it() -> None:
    # The interactive requests of a flood's first second herded onto the one replica whose seats were still
    # unknown: nothing showed it full, so it looked free, and they waited inside it behind batch requests.
    full = EndpointState(Endpoint("c", "http://c:8000"), metrics=ReplicaMetrics(running=32, scraped_at=1.0,
                                                                                stale=False),
                         peer_seats=32, recent=1, grown=1, in_flight=1)  # one more sent since the scrape
    assert room_for([full], SaturationThresholds(queue=5), ClassStanding(alone=False)) == 0
    assert room_for([dataclasses.replace(full, peer_seats=None)], SaturationThresholds(queue=5),
                    ClassStanding(alone=False)) == 4  # the one sent since may be waiting
    assert room_for([full], SaturationThresholds(queue=5), ClassStanding()) == 5  # a class alone still probes
    assert requests_ahead(full, 0) == 2 and requests_ahead(dataclasses.replace(full, peer_seats=None), 0) == 0
    victims = {"c": [Holder(1), Holder(2), Holder(3)]}
    assert seat_to_free([full], victims, {}) == [Holder(2), Holder(3)]  # one beyond its peers' seats, plus one


def test_peer_seats_come_from_replicas_serving_the_same_model_or_of_unknown_models() -> None:
    models = {"a": frozenset({"m"}), "b": frozenset({"m", "n"}), "c": frozenset({"n"}), "d": frozenset(),
              "e": frozenset({"x"})}
    assert peer_seats({"a": 32, "b": 16}, models) == {"c": 16, "d": 16}  # d's models are unknown: any peer's count
    assert peer_seats({"d": 8, "a": 32}, models) == {"b": 8, "c": 8, "e": 8}  # d may serve anything


def test_a_page_that_lags_this_gateways_count_does_not_stall_the_growth_of_a_replica_of_unknown_seats() -> None:
    # A real CPU engine's page showed 0-3 running while kvgate had 4 open there, through a whole run: requests spend
    # much of their life in vLLM's server, on their way in or out of the scheduler. Growth counts from the scrape.
    lagging = replica("a", seats=None, running=2, in_flight=4)  # nothing sent since the scrape
    assert occupied(lagging) == 4  # what the replica holds still counts them
    assert room_for([lagging], SaturationThresholds(), ClassStanding(yields=True)) == 1  # one step past the scrape
    assert room_for([lagging], SaturationThresholds(queue=5), ClassStanding(alone=False)) == 5  # none sent since
    grown = dataclasses.replace(lagging, in_flight=5, recent=1, grown=1)
    assert room_for([grown], SaturationThresholds(), ClassStanding(yields=True)) == 0  # its step taken until a scrape


def test_a_prompt_fits_where_its_blocks_are_free_beside_what_changed_since_the_scrape() -> None:
    def cache(running: int, usage: float, kv_grown: float = 0.0, elsewhere: int = 0, in_flight: int = 0,
              recent: int = 0) -> EndpointState:  # 500 blocks of 16 tokens: 8,000 tokens
        metrics = ReplicaMetrics(running=running, kv_cache_usage=usage, block_size=16, num_gpu_blocks=500,
                                 scraped_at=1.0, stale=False)
        return EndpointState(Endpoint("a", "http://a:8000"), metrics=metrics, kv_grown=kv_grown, elsewhere=elsewhere,
                             in_flight=in_flight, recent=recent)

    assert kv_room(cache(4, 0.81), 1500) == 0  # 1,520 tokens free, less a block for each running one to grow
    assert kv_room(cache(3, 0.61), 1500) == 2  # 3,072 tokens free: two prompts of 94 blocks, each with one to grow
    assert kv_room(cache(3, 0.61, kv_grown=1520), 1500) == 1  # one sent since holds its prompt's blocks
    assert kv_room(cache(3, 0.61, kv_grown=64), 1500) == 1  # ... or only its question's, its system prompt shared
    assert kv_room(cache(4, 0.81), 100) == 11  # short prompts still fit beside long ones
    assert kv_room(cache(4, 0.81, kv_grown=-1620), 1500) == 2  # one finished since: its blocks are free
    # One that finished while another in flight still holds its system prompt freed only its question's blocks.
    assert kv_room(cache(4, 0.81, kv_grown=-80), 1500) == 1
    assert kv_room(cache(4, 0.81, kv_grown=-80, recent=-1), 1500) == 1  # the count finished says no more than that
    # One another gateway sent, or one the page missed on its way in: the running ones' mean, or the prompt if larger.
    assert kv_room(cache(3, 0.61, elsewhere=1), 1500) == 0
    assert kv_room(cache(3, 0.61, in_flight=4), 1500) == 0
    assert kv_room(cache(3, 0.61, in_flight=4, recent=1, kv_grown=1520), 1500) == 1  # sent since: counted once
    # A class that yields leaves room for a more important class's prompt beside its own, preemptible or not.
    leaving = ClassStanding(yields=True, alone=False, kv_reserve=1400)
    assert room_for([cache(3, 0.61)], SaturationThresholds(kv_cache=0.9), leaving, tokens=1500) == 1
    assert room_for([cache(3, 0.61)], SaturationThresholds(kv_cache=0.9), leaving, tokens=1700) == 0
    assert room_for([cache(3, 0.61)], SaturationThresholds(kv_cache=0.9),
                    dataclasses.replace(leaving, preemptible=True), tokens=1700) == 0
    assert room_for([cache(3, 0.61)], SaturationThresholds(kv_cache=0.9),
                    dataclasses.replace(leaving, yields=False), tokens=1700) == 1  # the class above is not active
    # A prompt whose system prompt a request in flight there holds takes only its question's blocks.
    full = [cache(4, 0.81)]
    assert room_for(full, SaturationThresholds(kv_cache=0.9), ClassStanding(alone=False),
                    tokens=PromptTokens(1500, {"a": 60})) >= 1
    assert room_for(full, SaturationThresholds(kv_cache=0.9), ClassStanding(alone=False),
                    tokens=PromptTokens(1500, {"b": 60})) == 0
    assert kv_room(EndpointState(Endpoint("b", "http://b:8000")), 10**6) == math.inf  # never scraped: no reason
    mixed = ClassStanding(alone=False)
    assert room_for([cache(4, 0.81)], SaturationThresholds(kv_cache=0.9), mixed, tokens=1500) == 0
    assert room_for([cache(4, 0.81)], SaturationThresholds(kv_cache=1.0), mixed, tokens=1500) == 5  # never full
    # Requests released together decide on one scrape: a replica with blocks for two takes two, not its queue's five.
    assert room_for([cache(3, 0.61)], SaturationThresholds(kv_cache=0.9), mixed, tokens=1500) == 2


def test_the_replicas_with_room_are_those_a_request_of_the_class_fits() -> None:
    def cache(key: str, usage: float) -> EndpointState:  # 500 blocks of 16 tokens, 5 running
        metrics = ReplicaMetrics(running=5, kv_cache_usage=usage, block_size=16, num_gpu_blocks=500, scraped_at=1.0,
                                 stale=False)
        return EndpointState(Endpoint(key, f"http://{key}:8000"), seats=8, metrics=metrics)

    fleet, limits, tokens = [cache("a", 0.82), cache("b", 0.5), cache("c", 0.1)], SaturationThresholds(), 1200
    # Where a prompt's blocks are counted, no class is held back by `kv_cache`: what is past it is the room the classes
    # below leave the class they yield to.
    assert with_room(fleet, limits, ClassStanding(alone=False), tokens) == {"a", "b", "c"}
    assert with_room(fleet, limits, ClassStanding(alone=False), 1400) == {"b", "c"}
    assert with_room(fleet, limits, ClassStanding(alone=False), 4000) == {"c"}  # 4,000 tokens fit only in c
    assert room_for(fleet, limits, ClassStanding(alone=False), 4000) == 1


def test_a_class_that_yields_keeps_a_more_important_prompts_room_on_one_replica_where_it_costs_the_fewest() -> None:
    def cache(key: str, usage: float) -> EndpointState:  # 500 blocks of 16 tokens, 5 of 8 seats running
        metrics = ReplicaMetrics(running=5, kv_cache_usage=usage, block_size=16, num_gpu_blocks=500, scraped_at=1.0,
                                 stale=False)
        return EndpointState(Endpoint(key, f"http://{key}:8000"), seats=8, metrics=metrics)

    limits, tokens = SaturationThresholds(), 1200  # each prompt takes 1,216 tokens: 76 blocks and one to grow by
    leaving = ClassStanding(yields=True, alone=False, kv_reserve=tokens)
    # 1,360, 3,920 and 7,120 tokens free: c keeps the room beside its three free seats' worth, so a still takes one.
    fleet = [cache("a", 0.82), cache("b", 0.5), cache("c", 0.1)]
    assert with_room(fleet, limits, leaving, tokens) == {"a", "b", "c"}
    assert room_for(fleet, limits, leaving, tokens) == 1 + 3 + 3
    # Two replicas with room for one prompt each: one keeps it (the first by key, as every gateway picks).
    twins = [cache("b", 0.82), cache("a", 0.82)]
    assert with_room(twins, limits, leaving, tokens) == {"b"}
    assert room_for(twins, limits, leaving, tokens) == 1
    assert with_room(twins, limits, dataclasses.replace(leaving, kv_reserve=0), tokens) == {"a", "b"}
    # Where no replica has the prompt's room, every one keeps it: a short prompt that fits waits until one has.
    full = [cache("a", 0.9)]
    assert with_room(full, limits, leaving, 100) == frozenset()
    assert with_room(full, limits, dataclasses.replace(leaving, kv_reserve=0), 100) == {"a"}


def test_requests_sent_since_a_scrape_wait_behind_the_kv_blocks_it_showed_free() -> None:
    # Requests decided on one scrape all saw the same free blocks: the seven released together on a KV-bound fleet
    # went to one replica, which had blocks for one of them, and waited inside it for 1-2 s.
    def cache(recent: int) -> EndpointState:  # 500 blocks of 16 tokens, 3,072 tokens free beside 3 running
        metrics = ReplicaMetrics(running=3, kv_cache_usage=0.61, block_size=16, num_gpu_blocks=500, scraped_at=1.0,
                                 stale=False)
        return EndpointState(Endpoint("a", "http://a:8000"), metrics=metrics, recent=recent)

    assert kv_seats(cache(0), 1500) == 5  # room for two prompts of 94 blocks, each with one to grow by
    assert [requests_ahead(cache(recent), 1500) for recent in range(5)] == [0, 0, 1, 2, 3]
    assert requests_ahead(cache(4), 0) == 0  # a prompt cached whole needs a block to grow by: 192 are free
    assert kv_seats(dataclasses.replace(cache(0), metrics=ReplicaMetrics(running=3)), 1500) is None  # size unknown
