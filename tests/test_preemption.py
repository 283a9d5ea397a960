"""Preemption: an interactive request takes the seat of a non-streamed batch request its replica has not answered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from kvgate.endpoints.fleet import Fleet
from kvgate.endpoints.types import Endpoint, EndpointState, ReplicaMetrics
from kvgate.simulator import SimFleet, SimOptions
from kvgate.policies.config import RoutingConfig
from kvgate.policies.priorities import PriorityConfig
from kvgate.policies.types import RequestInfo
from kvgate.router.admission import AdmissionConfig, AdmissionQueue
from kvgate.router.config import ConfigError, build_config
from kvgate.router.metrics import GatewayMetrics
from kvgate.router.preemption import PreemptionRegistry
from tests.harness import RunningGateway, running_gateway, wait_until
from tests.test_held_kv import chat

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
INTERACTIVE, BATCH = 0, 1


def replica(key: str, seats: int | None, occupied: int) -> EndpointState:
    metrics = ReplicaMetrics(running=occupied, scraped_at=1.0, stale=False)
    return EndpointState(Endpoint(key, f"http://{key}:8000"), metrics=metrics, seats=seats)


class Replicas:
    """The candidates the registry sees, settable per test."""

    def __init__(self, *states: EndpointState) -> None:
        self.states = states

    def __call__(self, model: str) -> tuple[EndpointState, ...]:
        return self.states


async def test_the_youngest_batch_request_on_a_full_replica_gives_up_its_seat() -> None:
    registry = PreemptionRegistry(Replicas(replica("a", seats=2, occupied=2)))
    older, younger = registry.track(MODEL, "a", BATCH), registry.track(MODEL, "a", BATCH)
    assert registry.has_victims(MODEL, INTERACTIVE)
    assert not registry.has_victims(MODEL, BATCH)  # a class never preempts its own
    assert registry.preempt(MODEL, INTERACTIVE) == 1
    assert younger.preempted and not older.preempted
    assert registry.freeing(MODEL) == 1  # until the preempted request lets go of its seat
    registry.untrack(younger)
    assert registry.freeing(MODEL) == 0
    registry.untrack(older)
    assert not registry.has_victims(MODEL, INTERACTIVE)


async def test_a_request_waiting_inside_a_replica_holds_no_seat_so_freeing_one_takes_two() -> None:
    # "a" holds one request beyond its seats: freeing a seat there preempts two; "b" is full with none waiting.
    registry = PreemptionRegistry(Replicas(replica("a", seats=2, occupied=3), replica("b", seats=2, occupied=2)))
    on_a = [registry.track(MODEL, "a", BATCH) for _ in range(3)]
    on_b = [registry.track(MODEL, "b", BATCH) for _ in range(2)]
    assert registry.preempt(MODEL, INTERACTIVE) == 1
    assert [entry.preempted for entry in on_b] == [False, True]
    assert not any(entry.preempted for entry in on_a)
    # Next, b's remaining request is older than a's youngest, but a now needs two and b needs one.
    registry2 = PreemptionRegistry(Replicas(replica("a", seats=2, occupied=3)))
    on_a2 = [registry2.track(MODEL, "a", BATCH) for _ in range(3)]
    assert registry2.preempt(MODEL, INTERACTIVE) == 2
    assert [entry.preempted for entry in on_a2] == [False, True, True]
    assert registry2.freeing(MODEL) == 1  # one seat, freed once both have let go
    registry2.untrack(on_a2[2])
    assert registry2.freeing(MODEL) == 1
    registry2.untrack(on_a2[1])
    assert registry2.freeing(MODEL) == 0


async def test_no_preemption_without_a_known_seat_count_or_a_less_important_request() -> None:
    registry = PreemptionRegistry(Replicas(replica("a", seats=None, occupied=4)))
    registry.track(MODEL, "a", BATCH)
    assert registry.preempt(MODEL, INTERACTIVE) == 0  # unknown seats: a preemption might free nothing
    registry = PreemptionRegistry(Replicas(replica("a", seats=1, occupied=1)))
    registry.track(MODEL, "a", INTERACTIVE)
    assert registry.preempt(MODEL, INTERACTIVE) == 0


async def test_a_prompt_that_does_not_fit_preempts_the_batch_request_that_frees_its_kv_blocks() -> None:
    page = ReplicaMetrics()
    fleet = Fleet(lambda key: page, lambda key: frozenset(), seats=4, routing=RoutingConfig())
    fleet.apply([Endpoint("a", "http://a:8000")])
    # Four batch requests fill "a"'s seats: three of tenant 1, sharing its 100-block system prompt, and one of tenant 2.
    batch = [chat(1, 1), chat(1, 2), chat(2, 3), chat(1, 4)]
    registries = [PreemptionRegistry(lambda model: fleet.snapshot().candidates(model), fleet) for _ in range(2)]
    entries = [[registry.track(MODEL, "a", BATCH, info) for info in batch] for registry in registries]
    for info in batch:
        fleet.acquire("a", info)
    fleet.scrape_started("a")
    page = ReplicaMetrics(running=4, kv_cache_usage=0.8, block_size=16, num_gpu_blocks=500, scraped_at=1.0,
                          stale=False)  # 1,536 tokens free: a 102-block prompt of another tenant takes 1,664
    fleet.scraped("a", ok=True)
    by_kv, by_seats = registries
    assert by_kv.preempt(MODEL, INTERACTIVE, chat(3, 9)) == 1
    # The youngest frees only its question's blocks: tenant 2's request frees its system prompt too.
    assert [entry.preempted for entry in entries[0]] == [False, False, True, False]
    assert by_seats.preempt(MODEL, INTERACTIVE) == 1  # a seat alone: the youngest
    assert [entry.preempted for entry in entries[1]] == [False, False, False, True]
    # A prompt of tenant 1 takes only its question's blocks beside the system prompt its requests hold there: it
    # fits, so it needs only a seat, and the youngest gives up its own.
    by_kv.untrack(entries[0][2])
    assert by_kv.preempt(MODEL, INTERACTIVE, chat(1, 9)) == 1
    assert entries[0][3].preempted


def test_only_non_streamed_requests_of_a_preemptible_class_may_be_preempted_a_bounded_number_of_times() -> None:
    queue = AdmissionQueue(AdmissionConfig(max_preemptions=2), PriorityConfig(), lambda *args: 1.0, GatewayMetrics(),
                           PreemptionRegistry(Replicas()))
    batch = RequestInfo(model=MODEL, priority_class="batch")
    assert queue.preemptible(batch)
    assert queue.preemptible(batch, preemptions=1)
    assert not queue.preemptible(batch, preemptions=2)
    assert not queue.preemptible(RequestInfo(model=MODEL, priority_class="batch", stream=True))
    assert not queue.preemptible(RequestInfo(model=MODEL, priority_class="interactive"))
    off = AdmissionQueue(AdmissionConfig(preemptible=()), PriorityConfig(), lambda *args: 1.0, GatewayMetrics())
    assert not off.preemptible(batch)


def _chat(content: str, tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": tokens, "stream": stream}


async def _first_token_s(client: aiohttp.ClientSession, url: str) -> float:
    """Seconds from sending a short streamed interactive request to its first chunk; reads it to the end."""
    started = asyncio.get_running_loop().time()
    async with client.post(url + "/v1/chat/completions", json=_chat("now", 4, stream=True),
                           headers={"x-priority": "interactive"}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.content.readline()
        first = asyncio.get_running_loop().time() - started
        assert b"[DONE]" in await resp.read()
    return first


@contextlib.asynccontextmanager
async def _one_replica(options: SimOptions) -> AsyncIterator[tuple[RunningGateway, aiohttp.ClientSession, Callable]]:
    """A simulated replica behind kvgate told its seats: the gateway, a client and the replica's /sim/stats."""
    fleet = await SimFleet.start([0], options)
    try:
        async with running_gateway(endpoints=fleet.urls, scrape_interval=0.05, scrape_timeout=0.04,
                                   saturation={"seats": options.max_num_seqs}) as gw, aiohttp.ClientSession() as client:
            yield gw, client, fleet.replicas[0].stats
    finally:
        await fleet.stop()


async def test_interactive_request_preempts_a_whole_answer_batch_request_which_still_completes() -> None:
    # One replica with two seats, both running long non-streamed batch requests, more batch queued in kvgate.
    tokens = 200
    options = SimOptions(speed=2.0, max_num_seqs=2, default_max_tokens=tokens)
    async with _one_replica(options) as (gw, client, replica_stats):

        async def batch(n: int) -> dict:
            async with client.post(gw.url + "/v1/chat/completions", json=_chat(f"job {n}", tokens, stream=False),
                                   headers={"x-priority": "batch"}) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        jobs = [asyncio.create_task(batch(n)) for n in range(3)]
        await wait_until(lambda: replica_stats()["running"] == 2 and gw.gateway.admission.describe()["waiting"] == 1,
                         timeout=10)
        first = await asyncio.wait_for(_first_token_s(client, gw.url), 10)
        answers = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        metrics = await (await client.get(gw.url + "/metrics")).text()
        aborts = replica_stats()["aborts"]
    batch_request_s = tokens * (options.decode_step_seconds + 2 * options.decode_seconds_per_seq) / options.speed
    assert first < batch_request_s / 4  # it did not wait for a batch request to finish
    assert all(len(answer["choices"][0]["message"]["content"].split()) == tokens for answer in answers)
    assert aborts == 1  # the replica aborted the preempted request ...
    assert 'kvgate_admission_preempted_total{priority_class="batch"} 1.0' in metrics  # ... which kvgate sent again


async def test_streamed_batch_requests_are_never_preempted() -> None:
    async with _one_replica(SimOptions(speed=2.0, max_num_seqs=1, default_max_tokens=60)) as (gw, client, stats):
        async with client.post(gw.url + "/v1/chat/completions", json=_chat("job", 60, stream=True),
                               headers={"x-priority": "batch"}) as resp:
            await resp.content.readline()  # running
            interactive = asyncio.create_task(_first_token_s(client, gw.url))
            streamed = await resp.read()
        await asyncio.wait_for(interactive, 30)
        aborts = stats()["aborts"]
    assert b"[DONE]" in streamed
    assert aborts == 0


def test_preemptible_classes_must_exist() -> None:
    with pytest.raises(ConfigError, match="admission.preemptible"):
        build_config({"endpoints": "http://127.0.0.1:1"}, {"admission": {"preemptible": "bulk"}})
    assert build_config({"endpoints": "http://127.0.0.1:1"}, {"admission": {"preemptible": ""}}).admission.preemptible == ()
