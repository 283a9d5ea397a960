"""Replica seats: learning vLLM's max_num_seqs from /metrics, what a replica holds now, and seats kept free."""

from __future__ import annotations

import asyncio
import statistics

import aiohttp
import pytest

from kvgate.endpoints.fleet import Fleet
from kvgate.endpoints.types import Endpoint, EndpointState, FleetSnapshot, ReplicaMetrics
from kvgate.simulator import SimFleet, SimOptions
from kvgate.policies.cache_aware import CacheAwarePolicy
from kvgate.policies.config import RoutingConfig
from kvgate.policies.capacity import (ClassStanding, SaturationThresholds, estimated_waiting, fleet_headroom,
                                      free_seats, occupied, room_for)
from kvgate.policies.types import RequestInfo
from kvgate.router.config import ConfigError, build_config
from tests.harness import running_gateway, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TOKENS = 200


def seated(key: str, seats: int | None, running: int = 0, waiting: int = 0, recent: int = 0) -> EndpointState:
    metrics = ReplicaMetrics(running=running, waiting=waiting, scraped_at=1.0, stale=False)
    # nothing sent or finished while the scrape was in flight: the net growth since it is what was sent since
    return EndpointState(Endpoint(key, f"http://{key}:8000"), metrics=metrics, recent=recent, grown=recent,
                         seats=seats)


class Scrapes:
    """What the last scrape of each replica said, as the scraper would hand it to the fleet."""

    def __init__(self) -> None:
        self.pages: dict[str, ReplicaMetrics] = {}

    def __call__(self, key: str) -> ReplicaMetrics:
        return self.pages.get(key, ReplicaMetrics())

    def scrape(self, fleet: Fleet, key: str, running: int, waiting: int, kv_cache_usage: float = 0.0) -> None:
        fleet.scrape_started(key)
        self.pages[key] = ReplicaMetrics(running=running, waiting=waiting, kv_cache_usage=kv_cache_usage,
                                         scraped_at=1.0, stale=False)
        fleet.scraped(key, ok=True)


def fleet_with(scrapes: Scrapes, *keys: str, seats: int = 0) -> Fleet:
    fleet = Fleet(scrapes, lambda key: frozenset(), seats=seats)
    fleet.apply([Endpoint(key, f"http://{key}:8000") for key in keys])
    return fleet


def seats_of(fleet: Fleet, key: str) -> int | None:
    state = fleet.snapshot().get(key)
    assert state is not None
    return state.seats


def test_what_a_replica_holds_counts_what_was_sent_and_finished_since_its_scrape() -> None:
    state = seated("a", seats=8, running=8, waiting=3, recent=-2)
    assert occupied(state) == 9
    assert estimated_waiting(state) == 1  # two of the three waiting took the seats that freed up
    assert free_seats(state) == 0
    assert free_seats(seated("a", seats=8, running=5, recent=1)) == 2
    unknown = seated("a", seats=None, running=8, waiting=3, recent=2)
    assert free_seats(unknown) is None and estimated_waiting(unknown) == 5  # every send counts as waiting


def test_seats_are_learned_from_a_queue_seen_twice_and_only_grow() -> None:
    scrapes = Scrapes()
    fleet = fleet_with(scrapes, "a")
    scrapes.scrape(fleet, "a", running=3, waiting=1)
    assert seats_of(fleet, "a") is None  # a lone arrival between two engine steps proves nothing
    scrapes.scrape(fleet, "a", running=4, waiting=0)
    scrapes.scrape(fleet, "a", running=6, waiting=2)
    scrapes.scrape(fleet, "a", running=7, waiting=3)
    assert seats_of(fleet, "a") is None  # queued beside a running count that moves: arrivals between steps
    scrapes.scrape(fleet, "a", running=8, waiting=5)
    scrapes.scrape(fleet, "a", running=8, waiting=4)
    assert seats_of(fleet, "a") == 8
    scrapes.scrape(fleet, "a", running=2, waiting=0)
    assert seats_of(fleet, "a") == 8
    scrapes.scrape(fleet, "a", running=10, waiting=0)  # it ran more than that: the estimate was low
    assert seats_of(fleet, "a") == 10


def test_a_queue_behind_a_full_kv_cache_teaches_no_seats() -> None:
    scrapes = Scrapes()
    fleet = fleet_with(scrapes, "a")
    for _ in range(3):  # long prompts filled the KV cache: the queue waits for blocks, not seats
        scrapes.scrape(fleet, "a", running=6, waiting=2, kv_cache_usage=0.95)
    assert seats_of(fleet, "a") is None
    scrapes.scrape(fleet, "a", running=9, waiting=2, kv_cache_usage=0.5)
    scrapes.scrape(fleet, "a", running=9, waiting=3, kv_cache_usage=0.5)
    assert seats_of(fleet, "a") == 9


def test_a_replica_that_showed_a_queue_on_two_scrapes_in_a_row_has_been_full_whatever_bound_it() -> None:
    scrapes = Scrapes()
    fleet = fleet_with(scrapes, "a", "b")
    scrapes.scrape(fleet, "a", running=3, waiting=1)
    scrapes.scrape(fleet, "a", running=4, waiting=0)
    scrapes.scrape(fleet, "b", running=6, waiting=2, kv_cache_usage=0.95)
    snapshot = fleet.snapshot()
    assert [snapshot.get(key).filled for key in "ab"] == [False, False]  # type: ignore[union-attr]
    scrapes.scrape(fleet, "b", running=5, waiting=3, kv_cache_usage=0.95)  # its KV cache bound it: no seat count
    scrapes.scrape(fleet, "b", running=9, waiting=0, kv_cache_usage=0.5)
    state = fleet.snapshot().get("b")
    assert state is not None and state.filled and state.seats is None  # it stays so once shown
    fleet.apply([Endpoint("a", "http://a:8000")])
    fleet.apply([Endpoint(key, f"http://{key}:8000") for key in "ab"])
    state = fleet.snapshot().get("b")
    assert state is not None and not state.filled  # a replica that left and came back starts again


def test_seats_learned_on_one_replica_guide_the_others_of_its_model_until_they_show_their_own() -> None:
    scrapes = Scrapes()
    models = {"a": frozenset({"m"}), "b": frozenset({"m"}), "c": frozenset({"other"})}
    fleet = Fleet(scrapes, models.__getitem__)
    fleet.apply([Endpoint(key, f"http://{key}:8000") for key in models])
    for _ in range(2):
        scrapes.scrape(fleet, "a", running=32, waiting=2)
    snapshot = fleet.snapshot()
    assert [(snapshot.get(key).seats, snapshot.get(key).peer_seats) for key in "abc"] == [  # type: ignore[union-attr]
        (32, None), (None, 32), (None, None)]  # c serves another model: a's seats say nothing about it
    for _ in range(2):
        scrapes.scrape(fleet, "b", running=40, waiting=1)
    state = fleet.snapshot().get("b")
    assert state is not None and (state.seats, state.peer_seats) == (40, None)  # its own count, once shown


def test_configured_seats_win_and_learned_seats_leave_with_their_replica() -> None:
    scrapes = Scrapes()
    fleet = fleet_with(scrapes, "a", "b")
    for _ in range(2):
        scrapes.scrape(fleet, "a", running=8, waiting=1)
    assert seats_of(fleet, "a") == 8 and seats_of(fleet, "b") is None
    fleet.apply([Endpoint("b", "http://b:8000")])
    fleet.apply([Endpoint("a", "http://a:8000"), Endpoint("b", "http://b:8000")])
    assert seats_of(fleet, "a") is None  # a replica that came back is learned afresh
    configured = fleet_with(scrapes, "a", seats=16)
    assert seats_of(configured, "a") == 16


def test_requests_sent_while_a_scrape_is_in_flight_still_count() -> None:
    scrapes = Scrapes()
    fleet = fleet_with(scrapes, "a", seats=8)
    fleet.acquire("a")
    fleet.acquire("a")
    fleet.scrape_started("a")
    fleet.acquire("a")  # sent while the page was being read: it may or may not be in it
    fleet.release("a")  # finished meanwhile: counted as finished before the page
    scrapes.pages["a"] = ReplicaMetrics(running=2, scraped_at=1.0, stale=False)
    fleet.scraped("a", ok=True)
    state = fleet.snapshot().get("a")
    assert state is not None and occupied(state) == 3  # errs high, never low


def test_a_request_that_replaces_one_finished_while_a_scrape_is_in_flight_is_no_growth() -> None:
    # On a real CPU engine a short request ends and the next takes its place within one scrape of ~0.1-0.3 s; the
    # page reads 0 running (the requests spend most of their life in vLLM's server). Counting the replacement as
    # growth already taken held batch at one request on an idle engine of four seats for the whole load.
    scrapes = Scrapes()
    fleet = fleet_with(scrapes, "a")
    fleet.acquire("a")
    fleet.scrape_started("a")
    fleet.release("a")
    fleet.acquire("a")  # took the place of the one that finished
    scrapes.pages["a"] = ReplicaMetrics(running=0, scraped_at=1.0, stale=False)
    fleet.scraped("a", ok=True)
    state = fleet.snapshot().get("a")
    assert state is not None and state.recent == 1 and state.grown == 0
    assert room_for([state], SaturationThresholds(), ClassStanding(yields=True)) == 1  # one step past what it had
    fleet.acquire("a")
    state = fleet.snapshot().get("a")
    assert state is not None and state.grown == 1
    assert room_for([state], SaturationThresholds(), ClassStanding(yields=True)) == 0  # its step taken


def test_a_reserve_keeps_that_share_of_the_fleets_seats_free() -> None:
    limits = SaturationThresholds(queue=5, seats=8)
    fleet = [seated("a", seats=8, running=7), seated("b", seats=8, running=4)]  # 5 seats free in all
    assert fleet_headroom(fleet, limits) == 5  # known seats: the queue is kept in kvgate, not in the replicas
    assert fleet_headroom(fleet, limits, reserve=0.25) == 1  # 4 of the 16 seats stay free
    assert fleet_headroom(fleet, limits, reserve=0.5) == 0
    assert fleet_headroom(fleet, SaturationThresholds(queue=5, seats=8, seated_queue=2)) == 3 + 5  # queue bound
    learned = [seated("a", seats=8, running=8), seated("b", seats=8, running=8)]
    assert fleet_headroom(learned, limits) == 0  # configured: exactly the seats
    assert fleet_headroom(learned, SaturationThresholds(queue=5)) == 2  # learned: one past each count ...
    assert fleet_headroom(learned, SaturationThresholds(queue=5), probe=False) == 0  # ... unless not probing


def test_a_replica_of_unknown_seats_gets_no_queue_from_a_class_keeping_a_reserve() -> None:
    limits = SaturationThresholds(queue=5)
    unknown = seated("c", seats=None, running=8, waiting=2)
    assert fleet_headroom([unknown], limits) == 3  # a queue of 5 inside it
    assert fleet_headroom([unknown], limits, reserve=0.25, yields=True) == 0
    filling = seated("d", seats=None, running=3, recent=-1)  # one finished since the scrape
    assert fleet_headroom([filling], limits, reserve=0.25, yields=True) == 2  # its place, and one more
    sent = seated("d", seats=None, running=3, recent=1)
    assert fleet_headroom([sent], limits, reserve=0.25, yields=True) == 0  # one at a time until a scrape shows it


def test_a_request_no_cache_favours_goes_to_a_replica_with_a_free_seat() -> None:
    policy = CacheAwarePolicy(RoutingConfig())
    for n in range(20):
        request = RequestInfo(model=MODEL, priority_class="interactive", block_hashes=(n, n + 1000))
        full = FleetSnapshot((seated("a", seats=4, running=4), seated("b", seats=4, running=4),
                              seated("c", seats=4, running=3)))
        decision = policy.pick(request, full)
        assert decision is not None and decision.endpoint.key == "c"
        everywhere_full = FleetSnapshot((seated("a", seats=4, running=4), seated("b", seats=4, running=4)))
        assert policy.pick(request, everywhere_full) is not None  # then the usual placement, never none


@pytest.mark.parametrize(("settings", "message"), [
    ({"admission": {"reserve": {"gold": 0.1}}}, "unknown class 'gold'"),
    ({"admission": {"reserve": {"batch": 1.0}}}, "must be in [0, 1)"),
    ({"admission": {"reserve_idle_s": -1}}, "reserve_idle_s"),
    ({"saturation": {"seats": -1}}, "seats"),
])
def test_bad_reserve_and_seat_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({"endpoints": "http://127.0.0.1:1"}, settings)
    assert message in str(caught.value)


async def test_gateway_learns_the_seats_and_keeps_some_free_for_interactive() -> None:
    # One replica with 4 seats flooded with batch: kvgate learns the 4 from /metrics, then keeps one free.
    options = SimOptions(speed=2.0, max_num_seqs=4, default_max_tokens=TOKENS)
    fleet = await SimFleet.start([0], options)
    url = fleet.urls[0]
    try:
        async with running_gateway(endpoints=fleet.urls, scrape_interval=0.05, scrape_timeout=0.04,
                                   admission={"reserve": {"batch": 0.25}, "reserve_idle_s": 120}) as gw, \
                aiohttp.ClientSession() as client:

            async def send(cls: str) -> float:
                body = {"model": MODEL, "messages": [{"role": "user", "content": cls}], "max_tokens": TOKENS,
                        "stream": True}
                started = asyncio.get_running_loop().time()
                async with client.post(gw.url + "/v1/chat/completions", json=body,
                                       headers={"x-priority": cls}) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.content.readline()  # the first chunk
                    first = asyncio.get_running_loop().time() - started
                    await resp.read()
                return first

            seats = lambda: next(e["seats"] for e in gw.gateway.describe()["endpoints"] if e["url"] == url)  # noqa: E731
            replica = lambda: gw.gateway.fleet.snapshot().get(url)  # noqa: E731
            # An idle replica takes a burst at once (kvgate does not know its seats); its queue shows it has 4.
            first_wave = [asyncio.create_task(send("batch")) for _ in range(12)]
            await wait_until(lambda: seats() == 4, timeout=10)
            await asyncio.wait_for(asyncio.gather(*first_wave), 60)
            await asyncio.wait_for(send("interactive"), 30)  # interactive traffic: batch now keeps a seat free
            batch = [asyncio.create_task(send("batch")) for _ in range(24)]
            # Batch waits in kvgate while the replica holds at most three: by kvgate's estimate and in fact
            # (a request sent just before a scrape can reach the replica after the page it reads).
            held = lambda: sum(fleet.replicas[0].stats()[k] for k in ("running", "waiting"))  # noqa: E731
            await wait_until(lambda: occupied(replica()) <= 3 and held() <= 3
                             and gw.gateway.admission.describe()["waiting"] > 0, timeout=30)
            # One after another, each while batch waits: kvgate's estimate can trail the replica by a request
            # for a scrape (a stream's end seen after the page that no longer counts it), so judge the median.
            interactive = [await asyncio.wait_for(send("interactive"), 10) for _ in range(3)]
            await asyncio.wait_for(asyncio.gather(*batch), 90)
    finally:
        await fleet.stop()
    batch_request_s = TOKENS * (options.decode_step_seconds + 4 * options.decode_seconds_per_seq) / options.speed
    # It took the free seat (tens of ms) instead of waiting for a batch request to end (0 to 1.6 s).
    assert statistics.median(interactive) < batch_request_s / 8, interactive


def test_a_learned_seat_count_lets_one_request_past_it_and_a_configured_one_does_not() -> None:
    full = [seated("a", seats=6, running=6)]
    assert fleet_headroom(full, SaturationThresholds(queue=5)) == 1  # learned: it may have more seats
    assert fleet_headroom(full, SaturationThresholds(queue=5, seats=6)) == 0  # configured: it has not


def test_a_reserve_never_takes_the_last_seat() -> None:
    tiny = [seated("a", seats=1, running=0)]
    assert fleet_headroom(tiny, SaturationThresholds(seats=1), reserve=0.9) == 1
