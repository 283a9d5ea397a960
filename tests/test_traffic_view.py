"""The share of its replicas' traffic a gateway knows of, as plain data and through real gateways on a simulated fleet."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.policies.traffic_view import HORIZON, MIN_FINISHED, MIN_HELD, TrafficView
from kvgate.router.gateway import Gateway
from kvgate.simulator import SimFleet, SimOptions
from tests.harness import running_gateway, wait_until


def serve(view: TrafficView, replica: str, sent: int, finished: list[int], others: int = 0) -> None:
    """`sent` requests this gateway knows of, `others` sent by routers it does not hear from, all finished, then a
    scrape of the engine's counter (`finished`, updated)."""
    for _ in range(sent):
        view.sent(replica)
    finished[0] += sent + others
    view.scraped(replica, finished[0])


def test_the_share_is_what_the_gateway_knew_of_over_what_the_engines_finished_once_enough_did() -> None:
    view, a, b = TrafficView(), [0], [0]
    view.scraped("a", 0)
    view.scraped("b", 0)
    serve(view, "a", 20, a)
    serve(view, "b", 20, b)
    assert view.seen_share() is None and not view.partial()  # 40 finished: too few to judge
    serve(view, "a", 20, a, others=40)
    assert view.seen_share() == pytest.approx(60 / 100) and view.partial()
    view.forget("a")
    assert view.seen_share() is None  # replica b alone has finished 20


def test_requests_before_the_first_scrape_count_on_neither_side_and_a_restart_starts_a_new_baseline() -> None:
    view, engine = TrafficView(), [500]
    view.sent("a")  # before any scrape: the engine's side has no baseline to count it against
    view.scraped("a", engine[0])
    serve(view, "a", MIN_FINISHED, engine)
    assert view.seen_share() == pytest.approx(1.0) and not view.partial()
    engine[0] = 0  # the engine restarted
    view.scraped("a", engine[0])
    serve(view, "a", 10, engine, others=20)
    assert view.seen_share() == pytest.approx((MIN_FINISHED + 10) / (MIN_FINISHED + 30))


def test_before_requests_finish_the_share_is_what_the_gateway_had_open_over_what_the_engines_held() -> None:
    alone, beside_two, with_peers = TrafficView(), TrafficView(), TrafficView(peers=True)
    for view, open_requests in ((alone, 4), (beside_two, 1), (with_peers, 1)):
        view.scraped("a", 0, held=0, open_requests=0)  # idle
        assert view.seen_share() is None
        view.scraped("a", 0, held=MIN_HELD // 2, open_requests=open_requests)
        view.scraped("b", 0, held=MIN_HELD // 2, open_requests=open_requests)
    assert alone.seen_share() == 1.0 and not alone.partial()
    assert beside_two.seen_share() == pytest.approx(1 / 4) and beside_two.partial()
    assert with_peers.seen_share() is None and not with_peers.partial()  # peers' open requests are not this one's
    engine = [0]  # replica a's finished requests, as its first scrape read them
    for _ in range(MIN_FINISHED // 16):  # once enough finished, the engines' counters judge
        serve(beside_two, "a", 16, engine)
    assert beside_two.seen_share() == pytest.approx(1.0) and not beside_two.partial()


def test_the_share_follows_a_peer_gateway_that_starts_sending() -> None:
    view, engine = TrafficView(), [0]
    view.scraped("a", 0)
    for _ in range(HORIZON // 100):
        serve(view, "a", 100, engine)
    assert not view.partial()
    for _ in range(3 * HORIZON // 100):  # a second gateway, not sharing decisions, now takes half the traffic
        serve(view, "a", 50, engine, others=50)
    assert view.partial() and view.seen_share() < 0.55


async def send_chats(url: str, session: aiohttp.ClientSession, count: int, tag: str) -> None:
    """`count` short chats through the gateway at `url`, each answered 200."""
    for number in range(count):
        body = {"model": "m", "max_tokens": 2,
                "messages": [{"role": "user", "content": f"{tag} question {number}: " + "words " * 40}]}
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()


def view_of(gateway: Gateway) -> tuple[float | None, bool]:
    """The gateway's share of the traffic it knows of, and whether it routes as one seeing part of it."""
    return gateway.fleet.seen_share(), gateway.fleet.snapshot().partial_view


async def test_gateways_learn_from_the_engines_counters_whether_they_see_all_of_the_traffic() -> None:
    fleet = await SimFleet.start([0, 0], SimOptions(models=("m",), speed=50.0))
    scraping = {"endpoints": tuple(fleet.urls), "scrape_interval": 0.05, "scrape_timeout": 0.04}
    try:
        async with running_gateway(**scraping) as alone, aiohttp.ClientSession() as session:
            await wait_until(lambda: all(state.metrics.finished_requests == 0
                                         for state in alone.gateway.fleet.snapshot().endpoints))
            await send_chats(alone.url, session, MIN_FINISHED + 16, "alone")
            await wait_until(lambda: sum(state.metrics.finished_requests or 0 for state in
                                         alone.gateway.fleet.snapshot().endpoints) == MIN_FINISHED + 16)
            share, partial = view_of(alone.gateway)
            assert share == pytest.approx(1.0, abs=0.1) and not partial
            async with session.get(alone.url + "/metrics") as response:
                assert "kvgate_traffic_seen_ratio " in await response.text()
            async with running_gateway(**scraping) as second:  # a second gateway that shares nothing
                await wait_until(lambda: all(state.metrics.finished_requests is not None
                                             for state in second.gateway.fleet.snapshot().endpoints))
                await asyncio.gather(send_chats(alone.url, session, 3 * MIN_FINISHED, "one"),
                                     send_chats(second.url, session, 3 * MIN_FINISHED, "two"))
                await wait_until(lambda: sum(state.metrics.finished_requests or 0 for state in
                                             second.gateway.fleet.snapshot().endpoints) >= MIN_FINISHED * 6 + 16
                                 and alone.gateway.fleet.snapshot().partial_view)
                share, partial = view_of(second.gateway)
                assert share == pytest.approx(0.5, abs=0.1) and partial
                async with session.get(second.url + "/debug/fleet") as response:
                    assert (await response.json())["traffic_seen"]["partial_view"] is True
    finally:
        await fleet.stop()
