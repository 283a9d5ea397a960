"""The event subscriber keeps the precise index equal to what each simulated engine caches, over real ZMQ sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kvgate.endpoints import kv_events
from kvgate.endpoints.kv_events import KvEventAddresses, KvEventSubscriber
from kvgate.endpoints.types import Endpoint
from kvgate.engine.kv_events import BlockStored, encode_batch, encode_seq
from kvgate.policies.precise_index import PrecisePrefixIndex
from kvgate.simulator import SimFleet, SimOptions
from tests.harness import closed_port, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CACHE_BLOCKS = 48  # 768 tokens: a handful of prompts fill it, so evictions are constant


@pytest.fixture
async def fleet(tiny_model_dir) -> AsyncIterator[SimFleet]:
    sim = await SimFleet.start([0], SimOptions(tokenizer=str(tiny_model_dir), kv_events=True, speed=50.0,
                                               num_gpu_blocks=CACHE_BLOCKS, max_model_len=512))
    yield sim
    await sim.stop()


@asynccontextmanager
async def subscribed(fleet: SimFleet, replay: bool = True, address: str | None = None,
                     capacity: int | None = None) -> AsyncIterator[tuple[KvEventSubscriber, PrecisePrefixIndex]]:
    url = fleet.urls[0]
    publisher = fleet.replicas[0].kv_events
    index = PrecisePrefixIndex()
    subscriber = KvEventSubscriber(
        index, KvEventAddresses(explicit={url: address or publisher.endpoint}),
        KvEventAddresses(explicit={url: publisher.replay_endpoint} if replay else {}),
        replay_timeout_s=1.0, capacity_blocks=lambda key: capacity)
    subscriber.set_endpoints([Endpoint(key=url, url=url)])
    try:
        yield subscriber, index
    finally:
        await subscriber.close()


async def send_prompts(fleet: SimFleet, count: int, start: int = 0) -> None:
    async with aiohttp.ClientSession() as session:
        for number in range(start, start + count):
            text = f"Tenant {number} asks: " + " ".join(f"word{number * 7 + i}" for i in range(60))
            async with session.post(fleet.urls[0] + "/v1/completions",
                                    json={"model": MODEL, "prompt": text, "max_tokens": 4}) as response:
                assert response.status == 200, await response.text()


def stats_of(subscriber: KvEventSubscriber, fleet: SimFleet):
    return subscriber.stats()[fleet.urls[0]]


async def caught_up(subscriber: KvEventSubscriber, fleet: SimFleet) -> None:
    publisher = fleet.replicas[0].kv_events
    await wait_until(lambda: stats_of(subscriber, fleet).last_seq == publisher.last_seq)


async def test_belief_equals_what_the_engine_stored_minus_what_it_removed_after_evictions(fleet):
    async with subscribed(fleet) as (subscriber, index):
        await wait_until(lambda: stats_of(subscriber, fleet).connected)
        await send_prompts(fleet, 20)
        await caught_up(subscriber, fleet)
        key = fleet.urls[0]
        assert fleet.replicas[0].stats()["evictions"] > 0
        assert index.is_precise(key)
        assert index.engine_hashes(key) == fleet.replicas[0].cached_block_hashes()
        assert stats_of(subscriber, fleet).gaps == 0


async def test_a_sequence_gap_is_filled_from_the_replay_endpoint(fleet):
    async with subscribed(fleet) as (subscriber, index):
        await wait_until(lambda: stats_of(subscriber, fleet).connected)
        await send_prompts(fleet, 3)
        fleet.replicas[0].kv_events.drop_next(3)
        await send_prompts(fleet, 10, start=3)
        await caught_up(subscriber, fleet)
        stats = stats_of(subscriber, fleet)
        assert stats.gaps == 1 and stats.replays >= 1 and stats.replay_failures == 0
        assert index.is_precise(fleet.urls[0])
        assert index.engine_hashes(fleet.urls[0]) == fleet.replicas[0].cached_block_hashes()


async def test_without_replay_a_gap_makes_the_replica_approximate_until_its_cache_turned_over(fleet):
    async with subscribed(fleet, replay=False, capacity=CACHE_BLOCKS) as (subscriber, index):
        key = fleet.urls[0]
        await wait_until(lambda: stats_of(subscriber, fleet).connected)
        await send_prompts(fleet, 2)
        await caught_up(subscriber, fleet)
        assert index.is_precise(key)
        fleet.replicas[0].kv_events.drop_next(1)
        await send_prompts(fleet, 1, start=2)  # lost
        await send_prompts(fleet, 1, start=3)
        await caught_up(subscriber, fleet)
        assert stats_of(subscriber, fleet).gaps == 1 and not index.is_precise(key)
        await send_prompts(fleet, 20, start=4)
        await caught_up(subscriber, fleet)
        assert index.is_precise(key) and not stats_of(subscriber, fleet).rebuilding
        assert index.engine_hashes(key) <= fleet.replicas[0].cached_block_hashes()


async def test_an_engine_restart_clears_the_replicas_state(fleet):
    async with subscribed(fleet) as (subscriber, index):
        key = fleet.urls[0]
        await wait_until(lambda: stats_of(subscriber, fleet).connected)
        await send_prompts(fleet, 3)
        await caught_up(subscriber, fleet)
        assert index.blocks_held(key) > 0
        await fleet.replicas[0].restart_engine()
        await wait_until(lambda: index.blocks_held(key) == 0)  # the connection dropped: nothing is believed held
        await send_prompts(fleet, 1, start=50)
        await caught_up(subscriber, fleet)
        assert index.is_precise(key) and index.blocks_held(key) > 0
        assert index.engine_hashes(key) == fleet.replicas[0].cached_block_hashes()


async def test_all_blocks_cleared_empties_the_replicas_state(fleet):
    async with subscribed(fleet) as (subscriber, index):
        await wait_until(lambda: stats_of(subscriber, fleet).connected)
        await send_prompts(fleet, 3)
        fleet.replicas[0].reset()
        await caught_up(subscriber, fleet)
        assert index.blocks_held(fleet.urls[0]) == 0 and index.is_precise(fleet.urls[0])


async def test_a_subscriber_joining_late_rebuilds_the_whole_history_from_the_replay_buffer(fleet):
    await send_prompts(fleet, 5)
    async with subscribed(fleet) as (subscriber, index):
        await wait_until(lambda: index.is_precise(fleet.urls[0]))
        assert index.engine_hashes(fleet.urls[0]) == fleet.replicas[0].cached_block_hashes()


async def test_a_subscriber_joining_late_without_replay_stays_approximate(fleet):
    await send_prompts(fleet, 2)
    async with subscribed(fleet, replay=False) as (subscriber, index):
        await wait_until(lambda: stats_of(subscriber, fleet).connected)
        await send_prompts(fleet, 1, start=2)
        await caught_up(subscriber, fleet)
        assert not index.is_precise(fleet.urls[0]) and stats_of(subscriber, fleet).rebuilding


async def test_an_unreachable_publisher_leaves_the_replica_approximate(fleet):
    async with subscribed(fleet, address=f"tcp://127.0.0.1:{closed_port()}") as (subscriber, index):
        await send_prompts(fleet, 1)
        stats = stats_of(subscriber, fleet)
        assert not stats.connected and stats.batches == 0 and not index.is_precise(fleet.urls[0])


def test_addresses_come_from_a_host_template_or_explicit_pairs():
    template = KvEventAddresses.parse(["tcp://{host}:5557"], "kv_events_endpoint")
    assert template.address(Endpoint(key="ns/pod", url="http://10.0.0.7:8000")) == "tcp://10.0.0.7:5557"
    explicit = KvEventAddresses.parse(["http://a:1=tcp://127.0.0.1:7001", "http://a:2/=tcp://127.0.0.1:7002"], "x")
    assert explicit.address(Endpoint(key="http://a:2", url="http://a:2")) == "tcp://127.0.0.1:7002"
    assert explicit.address(Endpoint(key="http://b:1", url="http://b:1")) is None
    local = KvEventAddresses.parse(["http://a:1=ipc:///run/vllm/events"], "x")
    assert local.address(Endpoint(key="http://a:1", url="http://a:1")) == "ipc:///run/vllm/events"
    for bad in ("ipc://", "tcp://host-without-port", "http://a:1=udp://127.0.0.1:5557"):
        with pytest.raises(kv_events.KvEventsAddressError, match="tcp://HOST:PORT or ipc://PATH"):
            KvEventAddresses.parse([bad], "x")


async def test_with_bind_the_subscriber_takes_events_from_an_engine_that_connects_to_it():
    url, address = "http://127.0.0.1:1", f"tcp://127.0.0.1:{closed_port()}"
    index = PrecisePrefixIndex()
    subscriber = KvEventSubscriber(index, KvEventAddresses(explicit={url: address}), KvEventAddresses(), bind=True)
    subscriber.set_endpoints([Endpoint(key=url, url=url)])
    engine = zmq.asyncio.Context.instance().socket(zmq.PUB)
    engine.connect(address)  # what vLLM does with an endpoint without `*`
    try:
        await wait_until(lambda: subscriber.stats()[url].connected)
        stored = BlockStored((7,), None, tuple(range(16)), 16)
        for _ in range(50):  # a PUB drops what it sends before the subscription reached it: send until it lands
            await engine.send_multipart([b"kv-events", encode_seq(0), encode_batch(0.0, [stored])])
            await asyncio.sleep(0.1)
            if index.blocks_held(url):
                break
        assert index.blocks_held(url) == 1 and index.is_precise(url)
    finally:
        engine.close(linger=0)
        await subscriber.close()



async def test_an_address_another_subscriber_holds_is_logged_and_bound_once_it_is_free(caplog, monkeypatch):
    monkeypatch.setattr(kv_events, "_RETRY_S", 0.1)
    url, address = "http://127.0.0.1:1", f"tcp://127.0.0.1:{closed_port()}"
    first, second = (KvEventSubscriber(PrecisePrefixIndex(), KvEventAddresses(explicit={url: address}),
                                       KvEventAddresses(), bind=True) for _ in range(2))
    engine = zmq.asyncio.Context.instance().socket(zmq.PUB)
    try:
        first.set_endpoints([Endpoint(key=url, url=url)])
        engine.connect(address)
        await wait_until(lambda: first.stats()[url].connected)
        second.set_endpoints([Endpoint(key=url, url=url)])
        await wait_until(lambda: "kv events cannot bind" in caplog.text)
        assert not second.stats()[url].connected
        await first.close()  # the address is free again: the second binds it and the engine reconnects to it
        await wait_until(lambda: second.stats()[url].connected, timeout=10)
    finally:
        engine.close(linger=0)
        await first.close()
        await second.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_a_sequence_that_starts_again_on_a_live_connection_clears_the_state(transport, tmp_path):
    url = "http://127.0.0.1:1"
    engine = zmq.asyncio.Context.instance().socket(zmq.PUB)
    if transport == "tcp":
        address = f"tcp://127.0.0.1:{engine.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        address = f"ipc://{tmp_path}/events"  # what vLLM binds for an ipc:// endpoint
        engine.bind(address)
    index = PrecisePrefixIndex()
    subscriber = KvEventSubscriber(index, KvEventAddresses(explicit={url: address}), KvEventAddresses())
    subscriber.set_endpoints([Endpoint(key=url, url=url)])

    async def publish(seq: int, first_token: int) -> None:
        stored = BlockStored((first_token,), None, tuple(range(first_token, first_token + 16)), 16)
        await engine.send_multipart([b"kv-events", encode_seq(seq), encode_batch(0.0, [stored])])

    try:
        await wait_until(lambda: subscriber.stats()[url].connected)
        for _ in range(50):  # until the subscription reached the PUB socket and seq 0 landed
            await publish(0, 100)
            await asyncio.sleep(0.1)
            if index.blocks_held(url):
                break
        await publish(1, 200)
        await wait_until(lambda: index.blocks_held(url) == 2)
        restarts = subscriber.stats()[url].restarts
        await publish(0, 300)  # a new engine on the same address: its sequence starts again
        await wait_until(lambda: subscriber.stats()[url].restarts == restarts + 1)
        assert index.blocks_held(url) == 1 and index.is_precise(url)
    finally:
        engine.close(linger=0)
        await subscriber.close()
