"""Gateway replicas sharing their routing decisions (router/peers.py): each routes from the whole fleet's history."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvgate.endpoints.types import Endpoint, EndpointState, FleetSnapshot, ReplicaMetrics
from kvgate.policies import RoutingConfig, build_policy, build_request_info
from kvgate.policies.capacity import occupied
from kvgate.policies.precise_index import PrecisePrefixIndex
from kvgate.router.config import ConfigError, build_config
from kvgate.router.peers import MAX_SHARED_TOKENS, DecisionPeers, SharedDecision
from tests.harness import closed_port, running_gateway, wait_until
from tests.recording_replica import MODEL, RecordingReplica, recording_replica

CONFIG = RoutingConfig()


def chat(conversation: int, turns: int) -> dict:
    """Turn `turns` of a conversation whose prompt no other conversation shares."""
    messages = [{"role": "system", "content": f"Conversation {conversation} opens here. " * 40}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} of conversation {conversation}: " + "details " * 40})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"Answer {turn}, with some detail to cache."})
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


def fleet() -> FleetSnapshot:
    return FleetSnapshot(tuple(EndpointState(Endpoint(key, f"http://{key}:8000")) for key in ("pod-a", "pod-b", "pod-c")))


def test_a_learned_decision_routes_the_next_turn_where_the_other_gateway_sent_the_first() -> None:
    snapshot = fleet()
    for conversation in range(6):
        first = build_request_info("chat", chat(conversation, 1), "interactive", CONFIG)
        second = build_request_info("chat", chat(conversation, 2), "interactive", CONFIG)
        alone = build_policy("cache-aware", CONFIG).pick(second, snapshot).endpoint.key
        elsewhere = next(state for state in snapshot.endpoints if state.key != alone)
        learner = build_policy("cache-aware", CONFIG)
        learner.learn(first, elsewhere, snapshot)  # another gateway sent the first turn off this one's choice
        decision = learner.pick(second, snapshot)
        assert decision.endpoint.key == elsewhere.key and decision.reason == "prefix_hit"


def test_a_shared_decision_survives_the_wire_with_what_routing_reads() -> None:
    request = build_request_info("chat", chat(1, 3), "interactive", CONFIG)
    frame = msgspec.msgpack.encode(SharedDecision.of("gw-1", request, "pod-b"))
    decoded = msgspec.msgpack.Decoder(SharedDecision).decode(frame)
    assert decoded.replica == "pod-b"
    learned = decoded.request()
    assert (learned.block_hashes, learned.anchor_blocks, learned.opening_blocks, learned.prompt_chars) == \
        (request.block_hashes, request.anchor_blocks, request.opening_blocks, request.prompt_chars)


def precise_policy(snapshot: FleetSnapshot):
    """A cache-aware policy whose every replica's KV events flow and show an empty cache."""
    index = PrecisePrefixIndex(hold_s=30.0)
    for state in snapshot.endpoints:
        index.set_precise(state.key, True)
    return build_policy("cache-aware", CONFIG, index)


def test_a_peers_precise_decision_counts_its_blocks_as_held_before_the_engines_events() -> None:
    snapshot = FleetSnapshot(tuple(dataclasses.replace(state, metrics=ReplicaMetrics(block_size=16))
                                   for state in fleet().endpoints))
    tokens = tuple(range(1000, 1400))
    first = dataclasses.replace(build_request_info("chat", chat(1, 1), "interactive", CONFIG), token_ids=tokens)
    later = dataclasses.replace(build_request_info("chat", chat(1, 2), "interactive", CONFIG),
                                token_ids=tokens + tuple(range(50)))
    alone = precise_policy(snapshot).pick(first, snapshot).endpoint.key
    elsewhere = next(state for state in snapshot.endpoints if state.key != alone)
    frame = msgspec.msgpack.encode(SharedDecision.of("gw-1", first, elsewhere.key))  # another gateway's choice
    learner = precise_policy(snapshot)
    learner.learn(msgspec.msgpack.Decoder(SharedDecision).decode(frame).request(), elsewhere, snapshot)
    decision = learner.pick(later, snapshot)
    assert decision.endpoint.key == elsewhere.key and decision.reason == "prefix_hit"


def test_a_prompt_too_long_to_share_travels_without_its_token_ids() -> None:
    request = dataclasses.replace(build_request_info("chat", chat(1, 1), "interactive", CONFIG),
                                  token_ids=(7,) * (MAX_SHARED_TOKENS + 1), anchor_tokens=300)
    shared = SharedDecision.of("gw", request, "a")
    assert (shared.token_ids, shared.anchor_tokens) == (None, 0) and shared.block_hashes == request.block_hashes


def test_token_ids_a_peer_could_not_hash_are_refused_at_decoding() -> None:
    request = dataclasses.replace(build_request_info("chat", chat(1, 1), "interactive", CONFIG), token_ids=(1 << 32,))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(SharedDecision).decode(msgspec.msgpack.encode(SharedDecision.of("gw", request, "a")))


def test_a_decision_made_after_shut_down_is_counted_as_dropped() -> None:
    events: list[str] = []
    peers = DecisionPeers(("127.0.0.1", closed_port()), (), lambda request, replica: True, events.append)
    peers.open()
    request = build_request_info("chat", chat(1, 1), "interactive", CONFIG)
    peers.publish(request, "pod-a")
    peers.close()
    peers.publish(request, "pod-a")
    assert events == ["published", "dropped"]


def test_peer_addresses_are_checked() -> None:
    assert build_config({"endpoints": ("http://a:1",), "peers": ("10.0.0.2:5600", "[::1]:5600")}).peer_addresses == \
        [("10.0.0.2", 5600), ("::1", 5600)]
    with pytest.raises(ConfigError, match="peers"):
        build_config({"endpoints": ("http://a:1",), "peers": ("no-port",)})
    with pytest.raises(ConfigError, match="peer_listen"):
        build_config({"endpoints": ("http://a:1",), "peer_listen": "host:port"})


@contextlib.asynccontextmanager
async def replicas(count: int) -> AsyncIterator[list[RecordingReplica]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(recording_replica()) for _ in range(count)]


@contextlib.contextmanager
def peer_publisher() -> Iterator[tuple[int, zmq.asyncio.Socket]]:
    """A peer gateway's decision publisher, bound on a free loopback port."""
    port = closed_port()
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    try:
        yield port, publisher
    finally:
        publisher.close(linger=0)
        context.destroy(linger=0)


def counted(gateway, event: str) -> float:
    return gateway.metrics.registry.get_sample_value("kvgate_peer_decisions_total", {"event": event}) or 0.0


async def test_two_gateways_route_each_others_conversations_to_where_their_turns_went() -> None:
    """Gateway A knows one replica only, so it sends every first turn there; gateway B, which knows all three and
    never saw those turns, sends every second turn to the same replica because it learned A's decisions."""
    port_a, port_b = closed_port(), closed_port()

    def heard(gateway) -> float:
        return counted(gateway, "learned") + counted(gateway, "unknown_replica")

    async with replicas(3) as fleet_replicas:
        urls = [replica.url for replica in fleet_replicas]
        async with running_gateway(endpoints=(urls[0],), peer_listen=f"127.0.0.1:{port_a}",
                                   peers=(f"127.0.0.1:{port_b}",)) as a, \
                running_gateway(endpoints=tuple(urls), peer_listen=f"127.0.0.1:{port_b}",
                                peers=(f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}")) as b:
            async with aiohttp.ClientSession() as http:
                await wait_until(lambda: b.gateway.fleet.routable_count() == 3 and a.gateway.fleet.routable_count(),
                                 timeout=10)
                for attempt in range(50):  # until both subscriptions are up (a PUB drops what nobody receives yet)
                    for gateway in (a, b):
                        async with http.post(gateway.url + "/v1/chat/completions", json=chat(-1 - attempt, 1)) as sent:
                            assert sent.status == 200
                    await asyncio.sleep(0.1)
                    if heard(a.gateway) and heard(b.gateway):
                        break
                learned_by_a, published_by_a, heard_by_b = \
                    counted(a.gateway, "learned"), counted(a.gateway, "published"), heard(b.gateway)
                for conversation in range(6):
                    async with http.post(a.url + "/v1/chat/completions", json=chat(conversation, 1)) as response:
                        assert response.status == 200
                await wait_until(lambda: heard(b.gateway) == heard_by_b + 6)
                before = [len(replica.received) for replica in fleet_replicas]
                for conversation in range(6):
                    async with http.post(b.url + "/v1/chat/completions", json=chat(conversation, 2)) as response:
                        assert response.status == 200
                after = [len(replica.received) for replica in fleet_replicas]
                await wait_until(lambda: counted(a.gateway, "learned") == learned_by_a + 6)
    assert [n - m for n, m in zip(after, before)] == [6, 0, 0]
    assert counted(a.gateway, "published") == published_by_a + 6
    # B hears its own decisions too (its address is among its peers) and ignores them
    assert heard(b.gateway) == heard_by_b + 6


async def test_frames_that_do_not_decode_or_name_unknown_replicas_are_counted_and_dropped() -> None:
    with peer_publisher() as (port, publisher):
        async with replicas(1) as (replica,), \
                running_gateway(endpoints=(replica.url,), peers=(f"127.0.0.1:{port}",)) as gateway:
            unknown = msgspec.msgpack.encode(SharedDecision("peer", "http://10.1.1.1:8000", MODEL, [1, 2], 0, 0, 64))
            known = msgspec.msgpack.encode(SharedDecision("peer", gateway.gateway.fleet.endpoints[0].key, MODEL,
                                                          [1, 2], 0, 0, 64))

            def all_counted() -> bool:
                return all(counted(gateway.gateway, event) for event in ("invalid", "unknown_replica", "learned"))

            for _ in range(100):  # until the subscription is up
                for frame in (b"\xc1 not msgpack", unknown, known):
                    await publisher.send(frame)
                if all_counted():
                    break
                await asyncio.sleep(0.05)
            assert all_counted()
            assert gateway.gateway.policy.index_sizes() == {gateway.gateway.fleet.endpoints[0].key: 2}
            async with aiohttp.ClientSession() as http, http.get(gateway.url + "/readyz") as response:
                assert response.status == 200  # garbage from a peer leaves the gateway serving


async def test_a_peers_decision_counts_on_its_replica_until_the_next_scrape() -> None:
    """Each gateway bounds load by what a replica holds; a peer's sends since the last scrape are part of it."""
    with peer_publisher() as (port, publisher):
        async with replicas(1) as (replica,), \
                running_gateway(endpoints=(replica.url,), peers=(f"127.0.0.1:{port}",), scrape_interval=60) as gateway:
            fleet = gateway.gateway.fleet
            key = fleet.endpoints[0].key
            await wait_until(lambda: not gateway.gateway.scraper.metrics(key).stale, timeout=10)
            for n in range(100):  # until the subscription is up: a PUB drops what nobody receives yet
                await publisher.send(msgspec.msgpack.encode(SharedDecision("peer", key, MODEL, [n], 0, 0, 64)))
                await asyncio.sleep(0.02)
                if counted(gateway.gateway, "learned"):
                    break
            learned = counted(gateway.gateway, "learned")
            assert learned and fleet.in_flight(key) == 0
            assert occupied(fleet.snapshot().get(key)) == learned  # the page showed an idle replica
            fleet.scrape_started(key)
            fleet.scraped(key, ok=True)
            assert occupied(fleet.snapshot().get(key)) == 0  # the next page shows what the peer sent, or its end


async def test_peers_are_the_pods_of_the_peer_service_as_they_come_and_go(api) -> None:
    """A peer appears in the peer Service's EndpointSlice: its decisions are learned; it leaves: they are not."""
    from tests.k8s_api import make_slice

    with peer_publisher() as (port, publisher):
        peer_slice = make_slice("kvgate-peers", "kvgate-peers-1", [("127.0.0.1", "kvgate-1", True, True, False)],
                                ports=[("peers", port)])
        async with replicas(1) as (replica,), \
                running_gateway(endpoints=(replica.url,), peer_service="kvgate-peers") as gateway:
            key = gateway.gateway.fleet.endpoints[0].key

            async def publish(count: int) -> None:
                for n in range(count):
                    await publisher.send(msgspec.msgpack.encode(SharedDecision("peer", key, MODEL, [n], 0, 0, 64)))
                    await asyncio.sleep(0.01)

            await publish(10)
            assert counted(gateway.gateway, "learned") == 0  # no peer listed yet
            api.apply_slice(peer_slice)
            for _ in range(100):
                await publish(5)
                if counted(gateway.gateway, "learned"):
                    break
            assert counted(gateway.gateway, "learned") > 0
            async with aiohttp.ClientSession() as http, http.get(gateway.url + "/debug/fleet") as response:
                assert (await response.json())["peers"]["subscribed"] == [f"127.0.0.1:{port}"]
            api.delete_slice("kvgate-peers-1")
            await wait_until(lambda: not gateway.gateway.peers.subscribed)
            await asyncio.sleep(0.2)  # what was already on its way
            learned = counted(gateway.gateway, "learned")
            await publish(20)
            assert counted(gateway.gateway, "learned") == learned
