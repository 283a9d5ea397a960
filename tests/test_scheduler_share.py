"""The share of a gateway's open requests that a replica's scheduler holds, learned from both sides' means."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.endpoints.types import Endpoint, EndpointState, ReplicaMetrics
from kvgate.policies.capacity import SaturationThresholds, free_seats, headroom, occupied
from kvgate.policies.scheduler_share import LOWEST, MIN_REQUESTS, SchedulerShares


def serve(shares: SchedulerShares, replica: str, requests: int, seconds: float, scheduled: float,
          engine: list[float], others: int = 0) -> None:
    """`requests` answered `seconds` after they were sent, each `scheduled` seconds in the scheduler, and `others`
    times as many from other gateways; then a scrape of the engine's counters (`engine`: requests and seconds)."""
    for _ in range(requests):
        shares.answered(replica, seconds)
    engine[0] += requests * (1 + others)
    engine[1] += requests * (1 + others) * scheduled
    shares.scraped(replica, engine[0], engine[1])


def test_the_share_is_the_engine_mean_over_the_gateway_mean_once_both_sides_counted_enough() -> None:
    shares, engine = SchedulerShares(), [100.0, 80.0]  # what the engine did before this gateway first scraped it
    shares.scraped("a", *engine)
    serve(shares, "a", MIN_REQUESTS - 1, seconds=0.7, scheduled=0.42, engine=engine)
    assert shares.share("a") == 1.0  # too few yet: every open request holds a seat
    serve(shares, "a", 1, seconds=0.7, scheduled=0.42, engine=engine, others=2)  # other gateways send the same mix
    assert shares.share("a") == pytest.approx(0.6)
    assert shares.share("b") == 1.0  # never scraped


def test_the_share_is_bounded_whatever_the_means_say() -> None:
    slow_server, engine = SchedulerShares(), [0.0, 0.0]
    slow_server.scraped("a", *engine)
    serve(slow_server, "a", 40, seconds=2.0, scheduled=0.1, engine=engine)
    assert slow_server.share("a") == LOWEST  # at most four open requests for each seat
    clocks_apart, engine = SchedulerShares(), [0.0, 0.0]
    clocks_apart.scraped("a", *engine)
    serve(clocks_apart, "a", 40, seconds=0.5, scheduled=0.6, engine=engine)
    assert clocks_apart.share("a") == 1.0  # never more than it has open


def test_an_engine_that_does_not_time_its_scheduler_keeps_every_open_request_on_a_seat() -> None:
    shares = SchedulerShares()
    for _ in range(3):
        serve(shares, "a", 40, seconds=0.5, scheduled=0.0, engine=[0.0, 0.0])  # histograms at zero (the simulator's)
    assert shares.share("a") == 1.0


def test_a_replica_counts_as_running_the_share_of_open_requests_its_scheduler_holds() -> None:
    # A CPU engine ran 4 of the 7-8 requests kvgate had open there, none waiting: the rest were in vLLM's server.
    metrics = ReplicaMetrics(running=4, waiting=0, scraped_at=1.0, stale=False)
    state = EndpointState(Endpoint("a", "http://a:8000"), metrics=metrics, in_flight=8, seats=8)
    assert occupied(state) == 8 and free_seats(state) == 0  # every open request on a seat
    learned = dataclasses.replace(state, scheduler_share=0.6)
    assert occupied(learned) == 5  # 4.8 of the 8 in the scheduler, 4 of them shown: one more it has not shown yet
    assert free_seats(learned) == 3
    assert headroom(learned, SaturationThresholds(seats=8), probe=False) == 3
    # Requests sent since the scrape still count whole: each is on its way to the scheduler.
    assert occupied(dataclasses.replace(learned, recent=3)) == 7
