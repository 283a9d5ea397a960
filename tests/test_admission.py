"""Priority classes and the admission queue: order under saturation, shedding, bounds, disconnects, starvation."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any

import aiohttp
import pytest

from kvgate.simulator import SimFleet, SimOptions
from kvgate.policies.capacity import ClassStanding
from kvgate.policies.prefix_keys import build_request_info
from kvgate.policies.priorities import PriorityConfig
from kvgate.router.priority_headers import PriorityError, classify
from kvgate.policies.types import RequestInfo
from kvgate.router.admission import AdmissionConfig, AdmissionQueue
from kvgate.router.errors import GatewayError
from kvgate.router.fair_queue import FairQueue
from kvgate.router.metrics import GatewayMetrics
from tests.harness import running_gateway, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class Room:
    """A settable fleet headroom; `reserved` of it is closed to a class asked to leave a reserve."""

    def __init__(self, free: float, reserved: float = 0) -> None:
        self.free = free
        self.reserved = reserved
        self.reserves: list[float] = []

    def __call__(self, request: RequestInfo, standing: ClassStanding) -> float:
        reserve = standing.kept_reserve
        self.reserves.append(reserve)
        return max(0.0, self.free - self.reserved) if reserve else self.free


def queue_with(room: Room, **bounds) -> AdmissionQueue:
    return AdmissionQueue(AdmissionConfig(**bounds), PriorityConfig(), room, GatewayMetrics())


def admit(queue: AdmissionQueue, request: RequestInfo) -> Coroutine[Any, Any, None]:
    return queue.admit(request, PriorityConfig().rank(request.priority_class))


def info(cls: str, n: int = 0, size: int = 100) -> RequestInfo:
    return RequestInfo(model="m", priority_class=cls, block_hashes=(n,), body_bytes=size)


async def admit_all(queue: AdmissionQueue, requests: list[RequestInfo], order: list[int]) -> list[asyncio.Task]:
    async def one(index: int, request: RequestInfo) -> None:
        await admit(queue, request)
        order.append(index)

    tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
    await asyncio.sleep(0)
    return tasks


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, "interactive"),
    ({"x-priority": "BATCH"}, "batch"),
    ({"x-priority": " Interactive "}, "interactive"),
    ({"x-gateway-inference-objective": "-1"}, "batch"),
    ({"x-gateway-inference-objective": "10"}, "interactive"),
    ({"x-gateway-inference-objective": "nightly-eval"}, "batch"),
])
def test_priority_class_comes_from_headers(headers, expected) -> None:
    config = PriorityConfig(objectives={"nightly-eval": "batch"})
    assert classify(headers, config) == expected


@pytest.mark.parametrize(("objective", "expected"), [
    ("chat", "critical"), ("code", "interactive"), ("default", "interactive"), ("eval", "batch"),
    ("nightly", "batch"), ("100", "critical"), ("-5", "batch"),
])
def test_pool_objectives_map_to_classes_by_priority_band(objective, expected) -> None:
    config = PriorityConfig(classes=("critical", "interactive", "batch"), default="interactive",
                            bands={"critical": 10, "interactive": 0}, objectives={"nightly": "batch"})
    pool_objectives = {"chat": 10, "code": 5, "default": 0, "eval": -1, "nightly": 50}
    headers = {"x-gateway-inference-objective": objective}
    assert classify(headers, config, objectives=pool_objectives) == expected


@pytest.mark.parametrize(("headers", "header"), [
    ({"x-priority": "urgent"}, "x-priority"),
    ({"x-gateway-inference-objective": "who-knows"}, "x-gateway-inference-objective"),
])
def test_unknown_priority_values_are_rejected_naming_the_header(headers, header) -> None:
    with pytest.raises(PriorityError) as caught:
        classify(headers, PriorityConfig())
    assert caught.value.header == header and header in str(caught.value)


async def test_requests_pass_straight_through_while_the_fleet_has_room() -> None:
    queue = queue_with(Room(3))
    for _ in range(3):
        await asyncio.wait_for(admit(queue, info("batch")), 1)
    assert queue.describe()["waiting"] == 0


async def test_saturated_fleet_dispatches_interactive_before_earlier_batch() -> None:
    room = Room(0)
    queue = queue_with(room, min_share=0)
    order: list[int] = []
    requests = [info("batch", 0), info("batch", 1), info("interactive", 2), info("batch", 3), info("interactive", 4)]
    tasks = await admit_all(queue, requests, order)
    assert queue.describe()["waiting"] == 5 and order == []
    room.free = 1  # one place: each finished request lets the next one go
    for _ in range(5):
        queue.release("m")
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [2, 4, 0, 1, 3]


def flow_info(flow: str, n: int) -> RequestInfo:
    return RequestInfo(model="m", priority_class="interactive", block_hashes=(n,), body_bytes=100, flow=flow)


async def test_flows_of_one_class_take_turns_so_a_flood_does_not_starve_another_tenant() -> None:
    room = Room(0)
    queue = queue_with(room)
    order: list[int] = []
    requests = [flow_info("flood", i) for i in range(6)] + [flow_info("quiet", 10), flow_info("quiet", 11)]
    tasks = await admit_all(queue, requests, order)
    room.free = 1
    for _ in range(8):
        queue.release("m")
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 6, 1, 7, 2, 3, 4, 5]  # the quiet tenant's requests go second and fourth, not last


async def test_a_full_class_sheds_the_flooding_flow_rather_than_a_newcomer() -> None:
    queue = queue_with(Room(0), class_max_requests={"interactive": 4})
    tasks = await admit_all(queue, [flow_info("flood", i) for i in range(4)], [])
    newcomer = asyncio.create_task(admit(queue, flow_info("quiet", 10)))
    await wait_until(lambda: any(task.done() for task in tasks))
    assert [task.done() for task in tasks] == [False, False, False, True]  # the flood's newest made room
    assert isinstance(tasks[3].exception(), GatewayError) and tasks[3].exception().status == 429
    assert not newcomer.done() and queue.describe()["waiting"] == 4
    with pytest.raises(GatewayError) as shed:
        await admit(queue, flow_info("flood", 5))  # still the largest flow: its own newcomer is shed
    assert shed.value.status == 429
    for task in [*tasks, newcomer]:
        task.cancel()
    await asyncio.gather(*tasks, newcomer, return_exceptions=True)


async def test_batch_gets_its_minimum_share_while_interactive_keeps_waiting() -> None:
    room = Room(0)
    queue = queue_with(room, min_share=0.25)
    order: list[int] = []
    requests = [info("batch", i) for i in range(3)] + [info("interactive", 10 + i) for i in range(9)]
    tasks = await admit_all(queue, requests, order)
    room.free = 1
    for _ in range(8):
        queue.release("m")
        await asyncio.sleep(0)
    served_batch = [i for i in order if i < 3]
    assert len(order) == 8 and served_batch == [0, 1]  # every 4th dispatch goes to the waiting batch
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_overflow_sheds_the_newest_batch_before_any_interactive() -> None:
    queue = queue_with(Room(0), max_requests=3)
    order: list[int] = []
    tasks = await admit_all(queue, [info("batch", 0), info("batch", 1), info("interactive", 2)], order)
    late = asyncio.create_task(admit(queue, info("interactive", 3)))
    await asyncio.sleep(0)
    results = await asyncio.gather(tasks[1], return_exceptions=True)
    assert isinstance(results[0], GatewayError) and results[0].status == 429
    assert results[0].headers["Retry-After"] == "2"
    extra_batch = asyncio.create_task(admit(queue, info("batch", 4)))
    (error,) = await asyncio.gather(extra_batch, return_exceptions=True)
    assert isinstance(error, GatewayError) and error.status == 429  # batch never displaces interactive
    assert queue.describe()["waiting"] == 3
    for task in (*tasks, late):
        task.cancel()
    await asyncio.gather(*tasks, late, return_exceptions=True)


async def test_queue_bounds_in_bytes_and_per_class_count() -> None:
    queue = queue_with(Room(0), max_bytes=1000, class_max_requests={"interactive": 1})
    first = asyncio.create_task(admit(queue, info("interactive", 0, size=600)))
    await asyncio.sleep(0)
    second = asyncio.create_task(admit(queue, info("interactive", 1, size=10)))
    big_batch = asyncio.create_task(admit(queue, info("batch", 2, size=600)))
    errors = await asyncio.gather(second, big_batch, return_exceptions=True)
    assert [e.status for e in errors] == [429, 429]
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


async def test_waiting_too_long_is_shed_with_429() -> None:
    queue = queue_with(Room(0), max_wait={"interactive": 30.0, "batch": 0.05})
    with pytest.raises(GatewayError) as caught:
        await asyncio.wait_for(admit(queue, info("batch")), 2)
    assert caught.value.status == 429
    assert queue.describe()["waiting"] == 0


async def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once() -> None:
    queue = queue_with(Room(0))
    task = asyncio.create_task(admit(queue, info("batch", size=500)))
    await asyncio.sleep(0)
    assert queue.describe()["waiting"] == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert queue.describe() == {"waiting": 0, "bytes": 0, "models": {}}


async def test_a_client_leaving_as_its_place_frees_up_leaks_no_place() -> None:
    room = Room(0)
    queue = queue_with(room)
    leaving = asyncio.create_task(admit(queue, info("interactive", 0)))
    staying = asyncio.create_task(admit(queue, info("interactive", 1)))
    await asyncio.sleep(0)
    leaving.cancel()  # the client goes away ...
    room.free = 1
    queue.release("m")  # ... in the same loop turn as a place frees up
    await asyncio.wait_for(staying, 1)  # the place goes to the next request, not to the one that left
    await asyncio.gather(leaving, return_exceptions=True)
    assert queue.describe() == {"waiting": 0, "bytes": 0, "models": {}}
    await asyncio.wait_for(admit(queue, info("interactive", 2)), 1)  # and nothing stays reserved


async def test_unknown_priority_header_gets_400_through_the_gateway() -> None:
    fleet = await SimFleet.start([0], SimOptions(speed=50.0))
    try:
        async with running_gateway(endpoints=fleet.urls) as gw, aiohttp.ClientSession() as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            async with client.post(gw.url + "/v1/chat/completions", json=body,
                                   headers={"x-priority": "vip"}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
    finally:
        await fleet.stop()
    assert error["param"] == "x-priority"


async def test_saturated_simulated_fleet_serves_interactive_first_and_completes_batch() -> None:
    # One replica running one sequence at a time; saturated as soon as one request waits.
    options = SimOptions(speed=4.0, max_num_seqs=1, default_max_tokens=4)
    fleet = await SimFleet.start([0], options)
    finished: list[str] = []
    try:
        async with running_gateway(endpoints=fleet.urls, saturation={"queue": 1}, scrape_interval=0.05,
                                   scrape_timeout=0.04) as gw, aiohttp.ClientSession() as client:
            await wait_until(lambda: not gw.gateway.scraper.metrics(fleet.urls[0]).stale)

            async def send(name: str, cls: str, max_tokens: int) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": name}], "max_tokens": max_tokens}
                async with client.post(gw.url + "/v1/chat/completions", json=body,
                                       headers={"x-priority": cls}) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                finished.append(name)

            # Long enough that the queue shows on several scrapes however busy the machine is (8 x 4 tokens were
            # done in about two scrapes, too few to learn from under load).
            batch = [asyncio.create_task(send(f"batch-{i}", "batch", 24)) for i in range(8)]
            # An idle replica takes the burst (its seats are not known yet); its queue teaches kvgate the one seat.
            await wait_until(lambda: (gw.gateway.fleet.snapshot().endpoints[0].seats or 0) == 1, timeout=10)
            interactive = asyncio.create_task(send("interactive", "interactive", 4))
            await asyncio.wait_for(asyncio.gather(interactive, *batch), 60)
    finally:
        await fleet.stop()
    assert len(finished) == 9
    # Batch requests queued before it were still waiting when the interactive one finished: they gave way.
    assert finished.index("interactive") < 6


def reserving_queue(room: Room, now: list[float], **bounds) -> AdmissionQueue:
    config = AdmissionConfig(reserve={"batch": 0.3}, reserve_idle_s=10.0, **bounds)
    return AdmissionQueue(config, PriorityConfig(), room, GatewayMetrics(), clock=lambda: now[0])


async def test_batch_leaves_the_reserve_free_only_while_interactive_traffic_is_recent() -> None:
    now = [0.0]
    room = Room(3, reserved=3)  # three places, all of them inside the reserve
    queue = reserving_queue(room, now)
    await asyncio.wait_for(admit(queue, info("batch", 0)), 1)  # no interactive traffic yet: no reserve
    await asyncio.wait_for(admit(queue, info("interactive", 1)), 1)
    waiting = asyncio.create_task(admit(queue, info("batch", 2)))
    await asyncio.sleep(0)
    assert queue.describe()["waiting"] == 1  # batch now leaves the reserve to interactive ...
    await asyncio.wait_for(admit(queue, info("interactive", 3)), 1)  # ... which passes the waiting batch
    now[0] = 9.0
    queue.refresh()
    await asyncio.sleep(0)
    assert not waiting.done()
    now[0] = 14.0  # ten seconds without an interactive request: the reserve is lifted
    queue.refresh()
    await asyncio.wait_for(waiting, 1)
    assert 0.3 in room.reserves and room.reserves[-1] == 0.0


async def test_batch_leaves_kv_room_for_the_largest_interactive_prompt_of_the_last_reserve_idle_s() -> None:
    now = [0.0]
    kept: list[int] = []

    def room(request: RequestInfo, standing: ClassStanding) -> float:
        kept.append(standing.kept_kv_reserve)
        return 1.0

    config = AdmissionConfig(reserve_idle_s=10.0)
    queue = AdmissionQueue(config, PriorityConfig(), room, GatewayMetrics(), clock=lambda: now[0],
                           prompt_tokens=lambda request: request.prompt_chars // 4)
    for chars, at in ((6400, 0.0), (400, 5.0)):
        now[0] = at
        await admit(queue, dataclasses.replace(info("interactive"), prompt_chars=chars))
    await admit(queue, dataclasses.replace(info("batch"), prompt_chars=40_000))
    now[0] = 12.0  # the 1,600-token prompt left the window; the 100-token one is in it
    await admit(queue, info("batch"))
    assert kept == [0, 0, 1600, 100]  # interactive leaves none; batch the largest interactive prompt in the window


async def test_the_minimum_share_of_batch_may_use_the_reserve() -> None:
    now = [0.0]
    room = Room(0, reserved=1)
    queue = reserving_queue(room, now, min_share=0.5)
    order: list[int] = []
    requests = [info("batch", 0), info("interactive", 1), info("interactive", 2), info("interactive", 3)]
    tasks = await admit_all(queue, requests, order)
    room.free = 1  # one place, inside the reserve: interactive's, except for batch's minimum share
    for _ in range(3):
        queue.release("m")
        await asyncio.sleep(0)
    assert order == [1, 0, 2]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Held:
    """Which requests a replica with room holds the prompt of (by their first block hash), and who was asked."""

    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.asked: list[int] = []

    def __call__(self, request: RequestInfo, standing: ClassStanding) -> bool:
        self.asked.append(request.block_hashes[0])
        return request.block_hashes[0] in self.held


def looking_ahead(room: Room, held: Held, now: list[float], **bounds) -> AdmissionQueue:
    config = AdmissionConfig(min_share=0, reserve={}, **bounds)
    return AdmissionQueue(config, PriorityConfig(), room, GatewayMetrics(), clock=lambda: now[0], held_with_room=held)


async def admitted_at_once(queue: AdmissionQueue, room: Room, cls: str) -> None:
    """One request of `cls` through a fleet with room, which is full after it."""
    room.free = 1
    await asyncio.wait_for(admit(queue, info(cls, 100)), 1)
    room.free = 0


async def release_all(queue: AdmissionQueue, room: Room, count: int) -> None:
    room.free = 1
    for _ in range(count):
        queue.release("m")
        await asyncio.sleep(0)


async def test_a_class_that_yields_releases_first_the_requests_held_where_there_is_room() -> None:
    now, room, held = [0.0], Room(0), Held({2, 4})
    queue = looking_ahead(room, held, now, lookahead=4)
    await admitted_at_once(queue, room, "interactive")  # interactive has traffic: batch yields
    order: list[int] = []
    tasks = await admit_all(queue, [info("batch", n) for n in range(6)], order)
    await release_all(queue, room, 6)
    await asyncio.gather(*tasks)
    assert order == [2, 4, 0, 1, 3, 5]  # 2 and 4 were held where room opened: they went ahead of 0, 1 and 3
    assert 5 not in held.asked[:4]  # only the next four are looked at


async def test_a_request_passed_over_lookahead_times_goes_next() -> None:
    now, room, held = [0.0], Room(0), Held({1, 2, 3, 4})
    queue = looking_ahead(room, held, now, lookahead=2)
    await admitted_at_once(queue, room, "interactive")
    order: list[int] = []
    tasks = await admit_all(queue, [info("batch", n) for n in range(5)], order)
    await release_all(queue, room, 5)
    await asyncio.gather(*tasks)
    assert order == [1, 2, 0, 3, 4]  # 0, held nowhere with room, waited two releases longer than its turn


async def test_a_class_alone_and_the_most_important_class_go_strictly_in_turn() -> None:
    for first, cls in ((None, "batch"), ("batch", "interactive")):
        now, room, held = [0.0], Room(0), Held({1, 2})
        queue = looking_ahead(room, held, now)
        if first:
            await admitted_at_once(queue, room, first)
        order: list[int] = []
        tasks = await admit_all(queue, [info(cls, n) for n in range(3)], order)
        await release_all(queue, room, 3)
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2] and held.asked == []


def test_the_requests_ahead_are_in_the_order_flows_take_turns_and_one_taken_uses_its_flows_turn() -> None:
    queue: FairQueue[RequestInfo] = FairQueue(lambda request: request.flow)
    for flow, n in (("a", 0), ("a", 1), ("a", 2), ("b", 10), ("c", 20), ("c", 21)):
        queue.append(flow_info(flow, n))
    assert [r.block_hashes[0] for r in queue.ahead(5)] == [0, 10, 20, 1, 21]
    queue.take(next(r for r in queue if r.block_hashes[0] == 10))  # b's turn is used: a, then c, go next
    assert [queue.popleft().block_hashes[0] for _ in range(5)] == [0, 20, 1, 21, 2]


async def test_the_gateway_finds_a_prompt_held_with_room_only_where_it_sent_that_prompt() -> None:
    fleet = await SimFleet.start([0, 0], SimOptions(speed=4.0, default_max_tokens=2))
    try:
        # Seats configured: while they are unknown, a class that yields grows one replica at a time (first_to_fill).
        async with running_gateway(endpoints=fleet.urls, scrape_interval=0.05, scrape_timeout=0.04,
                                   saturation={"seats": 8}) as gw, aiohttp.ClientSession() as client:
            await wait_until(lambda: not any(gw.gateway.scraper.metrics(url).stale for url in fleet.urls))

            def chat(tenant: str, question: str) -> dict[str, Any]:
                system = f"You are the assistant of tenant {tenant}. Answer from the handbook. " * 30
                return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                                      {"role": "user", "content": question}]}

            async with client.post(gw.url + "/v1/chat/completions", json=chat("one", "first")) as resp:
                assert resp.status == 200, await resp.text()
            routing, standing = gw.gateway.config.routing, ClassStanding(yields=True, alone=False)
            assert gw.gateway._held_with_room(build_request_info("chat", chat("one", "second"), "batch", routing),
                                              standing)
            assert not gw.gateway._held_with_room(build_request_info("chat", chat("two", "first"), "batch", routing),
                                                  standing)
    finally:
        await fleet.stop()
