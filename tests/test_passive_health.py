"""Passive health: consecutive connect failures take a replica out of rotation, with a growing backoff."""

from __future__ import annotations


import aiohttp

from kvgate.endpoints.health import PassiveHealth
from kvgate.simulator import SimFleet, SimOptions
from tests.harness import FakeClock, closed_port, running_gateway

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def test_breaker_opens_after_consecutive_failures_and_backs_off_longer_each_time() -> None:
    clock = FakeClock()
    health = PassiveHealth(threshold=3, base_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    health.failure("a", "connect")
    health.failure("a", "connect")
    assert health.healthy("a")
    health.failure("a", "timeout")
    assert not health.healthy("a") and health.open_keys() == ["a"]
    clock.now += 1.0
    assert health.healthy("a")  # half-open: real traffic probes it
    health.failure("a", "connect")
    assert not health.healthy("a")
    clock.now += 1.5
    assert not health.healthy("a")  # the second backoff is twice as long
    clock.now += 0.5
    health.failure("a", "connect")
    clock.now += 3.9
    assert not health.healthy("a")  # capped at 4 s
    clock.now += 0.2
    health.success("a")
    assert health.healthy("a") and health.open_keys() == []


def test_failures_of_requests_in_flight_when_it_broke_do_not_stretch_the_backoff() -> None:
    clock = FakeClock()
    health = PassiveHealth(threshold=1, base_backoff_s=1.0, max_backoff_s=30.0, clock=clock)
    for _ in range(10):  # ten streams on the replica all fail at the moment it dies
        health.failure("a", "stream_broken")
    clock.now += 1.0
    assert health.healthy("a")


def test_a_success_resets_the_count_and_4xx_is_not_a_failure() -> None:
    health = PassiveHealth(threshold=2, clock=FakeClock())
    health.failure("a", "connect")
    health.success("a")
    health.failure("a", "connect")
    assert health.healthy("a")


async def test_dead_replica_leaves_rotation_and_client_errors_do_not_count() -> None:
    fleet = await SimFleet.start([0], SimOptions(speed=50.0))
    dead = f"http://127.0.0.1:{closed_port()}"
    try:
        async with running_gateway(endpoints=[dead, fleet.urls[0]], policy="round-robin") as gw, \
                aiohttp.ClientSession() as client:
            for n in range(12):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{n}"}], "max_tokens": 1}
                async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            # 4xx answers from a live replica never take it out of rotation.
            for _ in range(5):
                bad = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}
                async with client.post(gw.url + "/v1/chat/completions", json=bad) as resp:
                    assert resp.status == 400
            open_keys = gw.gateway.fleet.health.open_keys()
            async with client.get(gw.url + "/metrics") as resp:
                metrics = await resp.text()
    finally:
        await fleet.stop()
    assert open_keys == [dead]
    retries = [line for line in metrics.splitlines() if line.startswith('kvgate_retries_total{cause="connect"}')]
    assert retries and float(retries[0].split()[-1]) == 3.0  # after 3 failures the dead replica gets no traffic
