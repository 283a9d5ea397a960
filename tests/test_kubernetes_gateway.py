"""The gateway on Kubernetes discovery end to end: the real client, the test API server, simulated replicas."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import aiohttp

from kvgate.simulator import SimFleet, SimOptions
from tests.harness import running_gateway, wait_until
from tests.k8s_api import make_slice

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOSTS = ("127.0.0.2", "127.0.0.3")  # one "pod IP" each; EndpointSlices give every pod the same port


def shared_free_port() -> int:
    for _ in range(20):
        with socket.socket() as first, socket.socket() as second:
            first.bind((HOSTS[0], 0))
            port = first.getsockname()[1]
            try:
                second.bind((HOSTS[1], port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on both loopback addresses")


@contextlib.asynccontextmanager
async def two_pods(api) -> AsyncIterator[tuple[int, list[SimFleet], list[tuple]]]:
    """Two ready pods of Service `vllm`, each a simulated replica on its own loopback address and the same port."""
    port = shared_free_port()
    fleets = [await SimFleet.start([port], SimOptions(speed=2.0), host=host) for host in HOSTS]
    pods = [(HOSTS[0], "vllm-a", True, True, False), (HOSTS[1], "vllm-b", True, True, False)]
    api.apply_slice(make_slice("vllm", "vllm-1", pods, ports=[("http", port)]))
    try:
        yield port, fleets, pods
    finally:
        for fleet in fleets:
            await fleet.stop()


async def test_terminating_pod_gets_no_new_requests_within_a_second_and_finishes_its_stream(api) -> None:
    async with two_pods(api) as (port, fleets, pods):
        async with running_gateway(discovery="kubernetes", service=["vllm"], port_name="http") as gw, \
                aiohttp.ClientSession() as client:
            await wait_until(lambda: gw.gateway.fleet.routable_count() == 2, timeout=10)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 60,
                    "stream": True}
            stream = await client.post(gw.url + "/v1/chat/completions", json=body)
            await stream.content.readuntil(b"\n\n")
            busy = next(i for i, f in enumerate(fleets) if f.replicas[0].stats()["running"] == 1)
            busy_key = f"default/{pods[busy][1]}"
            before = fleets[busy].replicas[0].stats()["requests"]

            draining = list(pods)
            draining[busy] = (HOSTS[busy], pods[busy][1], False, True, True)  # serving + terminating
            api.apply_slice(make_slice("vllm", "vllm-1", draining, ports=[("http", port)]))
            changed = time.monotonic()
            await wait_until(lambda: not next(e for e in gw.gateway.fleet.endpoints if e.key == busy_key).accepting,
                             timeout=1.0)
            assert time.monotonic() - changed < 1.0
            for n in range(10):
                short = {"model": MODEL, "messages": [{"role": "user", "content": f"q{n}"}], "max_tokens": 2}
                async with client.post(gw.url + "/v1/chat/completions", json=short) as resp:
                    assert resp.status == 200
            rest = await asyncio.wait_for(stream.content.read(), 30)
    assert fleets[busy].replicas[0].stats()["requests"] == before  # no new request reached the terminating pod
    assert rest.endswith(b"data: [DONE]\n\n") and b'"error"' not in rest


async def test_a_pod_that_leaves_takes_its_replica_series_off_the_gateways_metrics(api) -> None:
    async with two_pods(api) as (port, _fleets, pods):
        async with running_gateway(discovery="kubernetes", service=["vllm"], port_name="http",
                                   policy="round-robin") as gw, aiohttp.ClientSession() as client:
            await wait_until(lambda: gw.gateway.fleet.routable_count() == 2, timeout=10)
            for n in range(4):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{n}"}], "max_tokens": 2}
                async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            async with client.post(gw.url + "/v1/chat/completions", data=b"{bad") as resp:
                assert resp.status == 400
            before = await (await client.get(gw.url + "/metrics")).text()
            api.apply_slice(make_slice("vllm", "vllm-1", pods[:1], ports=[("http", port)]))
            await wait_until(lambda: len(gw.gateway.fleet.endpoints) == 1, timeout=5)
            after = await (await client.get(gw.url + "/metrics")).text()
    assert 'replica="default/vllm-b"' in before and 'replica="default/vllm-b"' not in after
    assert 'kvgate_requests_in_flight{replica="default/vllm-a"}' in after
    assert 'replica="default/vllm-a",route="/v1/chat/completions",status="200"' in after
    assert 'replica="-",route="/v1/chat/completions",status="400"' in after  # answered by the gateway itself
