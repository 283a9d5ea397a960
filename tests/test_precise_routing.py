"""Gateways route on what the simulated engines' KV events say they cache: shared truth, restarts, mixed fleets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import aiohttp
import pytest

from kvgate.simulator import SimFleet, SimOptions
from tests.harness import RunningGateway, running_gateway, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PREFIX = "Shared contract text, clause by clause. " * 110  # ~1,400 tokens: re-prefilling it (0.14 s) costs more than a
# request caught queued on a scrape (two places, 0.1 s), so the holder keeps it however busy the machine is


@pytest.fixture
async def fleet(tiny_model_dir) -> AsyncIterator[SimFleet]:
    sim = await SimFleet.start([0, 0, 0], SimOptions(tokenizer=str(tiny_model_dir), kv_events=True, speed=50.0,
                                                     max_model_len=2048))
    yield sim
    await sim.stop()


def event_settings(fleet: SimFleet, tiny_model_dir, with_events: int | None = None) -> dict:
    replicas = list(zip(fleet.urls, fleet.replicas))[:with_events]
    return {"endpoints": ",".join(fleet.urls), "scrape_interval": 0.05, "scrape_timeout": 0.04,
            "kv_events_endpoint": [f"{url}={replica.kv_events.endpoint}" for url, replica in replicas],
            "kv_events_replay_endpoint": [f"{url}={replica.kv_events.replay_endpoint}" for url, replica in replicas],
            "tokenizer": [f"{MODEL}={tiny_model_dir}"]}


async def served_counts(session: aiohttp.ClientSession, fleet: SimFleet) -> list[int]:
    counts = []
    for url in fleet.urls:
        async with session.get(url + "/sim/stats") as response:
            counts.append((await response.json())["requests"])
    return counts


async def complete(session: aiohttp.ClientSession, base_url: str, suffix: str) -> None:
    async with session.post(base_url + "/v1/completions",
                            json={"model": MODEL, "prompt": PREFIX + suffix, "max_tokens": 2}) as response:
        assert response.status == 200, await response.text()


async def precise_everywhere(gateway: RunningGateway, fleet: SimFleet) -> None:
    await wait_until(lambda: all(gateway.gateway.precise.is_precise(url) for url in fleet.urls))


async def test_every_gateway_sends_a_prefix_to_the_replica_whose_events_show_it(fleet, tiny_model_dir):
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as session:
        gateways = [await stack.enter_async_context(running_gateway(**event_settings(fleet, tiny_model_dir)))
                    for _ in range(3)]
        for gateway in gateways:
            await precise_everywhere(gateway, fleet)
        # The prefix reaches the third replica's cache without any gateway: only its events can tell.
        await complete(session, fleet.urls[2], "warm-up")
        await wait_until(lambda: all(g.gateway.precise.blocks_held(fleet.urls[2]) > 0 for g in gateways))
        before = await served_counts(session, fleet)
        for number in range(9):
            await complete(session, gateways[number % 3].url, f" question {number}")
        after = await served_counts(session, fleet)
        assert [b - a for a, b in zip(before, after)] == [0, 0, 9]


async def test_after_an_engine_restart_no_request_goes_there_for_the_prefix_it_lost(fleet, tiny_model_dir):
    async with running_gateway(**event_settings(fleet, tiny_model_dir)) as gateway, \
            aiohttp.ClientSession() as session:
        precise = gateway.gateway.precise
        await precise_everywhere(gateway, fleet)
        for url in fleet.urls[:2]:
            await complete(session, url, " warm-up")
        await wait_until(lambda: all(precise.blocks_held(url) > 0 for url in fleet.urls[:2]))
        await fleet.replicas[0].restart_engine()
        await wait_until(lambda: precise.blocks_held(fleet.urls[0]) == 0)
        before = await served_counts(session, fleet)
        for number in range(6):
            await complete(session, gateway.url, f" after restart {number}")
        after = await served_counts(session, fleet)
        assert [b - a for a, b in zip(before, after)] == [0, 6, 0]


async def test_a_mixed_fleet_routes_precisely_where_events_flow_and_shows_each_mode(fleet, tiny_model_dir):
    async with running_gateway(**event_settings(fleet, tiny_model_dir, with_events=2)) as gateway, \
            aiohttp.ClientSession() as session:
        await wait_until(lambda: all(gateway.gateway.precise.is_precise(url) for url in fleet.urls[:2]))
        await complete(session, fleet.urls[0], " straight to a replica with events")
        for number in range(6):
            await complete(session, gateway.url, f" mixed {number}")
        stats = gateway.gateway.kv_events.stats()
        await wait_until(lambda: stats[fleet.urls[0]].events > 0)
        async with session.get(gateway.admin_url + "/debug/fleet") as response:
            endpoints = {e["url"]: e for e in (await response.json())["endpoints"]}
        assert [endpoints[url]["routing"] for url in fleet.urls] == ["precise", "precise", "approximate"]
        assert endpoints[fleet.urls[2]]["kv_events"] is None
        events = [endpoints[url]["kv_events"] for url in fleet.urls[:2]]
        assert sum(e["events"] for e in events) > 0 and all(e["gaps"] == 0 for e in events)
        async with session.get(gateway.admin_url + "/metrics") as response:
            page = await response.text()
        assert f'kvgate_kv_events_precise{{replica="{fleet.urls[0]}"}} 1.0' in page
        assert "kvgate_kv_events_blocks_held" in page and "kvgate_precise_index_bytes" in page


async def test_a_burst_of_one_new_prefix_stays_on_one_replica_before_any_event_arrives(fleet, tiny_model_dir):
    async with running_gateway(**event_settings(fleet, tiny_model_dir), kv_events_hold=30.0) as gateway, \
            aiohttp.ClientSession() as session:
        await precise_everywhere(gateway, fleet)
        for replica in fleet.replicas:
            replica.kv_events.drop_next(1000)  # no event reaches the gateway: only the hold keeps the burst together
        before = await served_counts(session, fleet)
        for number in range(6):
            await complete(session, gateway.url, f" burst {number}")
        after = await served_counts(session, fleet)
        assert sorted(b - a for a, b in zip(before, after)) == [0, 0, 6]
        hits = gateway.gateway.metrics.decisions.labels("cache-aware", "prefix_hit")._value.get()
        assert hits >= 4  # the first placed it; the rest followed its held blocks (0 without the hold)


@pytest.mark.parametrize("body", [
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
    {"model": MODEL, "messages": ["not an object"]},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"function": "not an object"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "not a mapping"},
    {"model": MODEL, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {
        "name": "f", "arguments": "{not json"}}]}]},
])
async def test_bodies_the_template_cannot_render_are_forwarded_and_answered_by_the_engine(fleet, tiny_model_dir,
                                                                                            body):
    async with running_gateway(**event_settings(fleet, tiny_model_dir)) as gateway, \
            aiohttp.ClientSession() as session:
        async with session.post(gateway.url + "/v1/chat/completions", json={**body, "max_tokens": 2}) as response:
            answer = await response.json()
            assert response.status in (200, 400), answer
            assert response.status == 200 or answer["error"]["type"] == "BadRequestError"
        await complete(session, gateway.url, " still serving")


async def test_a_new_conversation_goes_where_the_events_show_its_system_prompt_not_to_its_home(fleet,
                                                                                               tiny_model_dir):
    system = "You are the contracts assistant of tenant seven. Quote the clause you rely on. " * 25

    async def chat(session: aiohttp.ClientSession, base_url: str, question: str) -> None:
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        async with session.post(base_url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()

    async def served_at(session: aiohttp.ClientSession, base_url: str, question: str) -> int:
        before = await served_counts(session, fleet)
        await chat(session, base_url, question)
        after = await served_counts(session, fleet)
        [served] = [n for n, (a, b) in enumerate(zip(before, after)) if b > a]
        return served

    # The gateway counts the system prompt's tokens as the engine's tokenizer makes them, so no replica holds more
    # than it: the request is placed, not continued where it is held, whatever the configured characters per token.
    async with running_gateway(**event_settings(fleet, tiny_model_dir), kv_events_hold=0.05,
                               routing={"chars_per_token": 8.0}) as precise, \
            running_gateway(endpoints=",".join(fleet.urls)) as approximate, aiohttp.ClientSession() as session:
        await precise_everywhere(precise, fleet)
        home = await served_at(session, precise.url, "first conversation")  # nobody holds it: its rendezvous home
        for url in fleet.urls:
            await session.post(url + "/sim/reset")
        await wait_until(lambda: all(precise.gateway.precise.blocks_held(url) == 0 for url in fleet.urls))
        holder = (home + 1) % 3
        await chat(session, fleet.urls[holder], "asked of one replica directly")
        await wait_until(lambda: precise.gateway.precise.blocks_held(fleet.urls[holder]) > 0)
        assert await served_at(session, precise.url, "second conversation") == holder
        # a gateway without the events has no such truth: placement by its own history would split gateways
        assert await served_at(session, approximate.url, "third conversation") == home
