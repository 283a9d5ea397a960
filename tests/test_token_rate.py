"""Characters per token learned from what a gateway sent and what the engine counted, as plain data."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from kvgate.endpoints.types import ReplicaMetrics
from kvgate.endpoints.vllm_metrics import parse_vllm_metrics
from kvgate.policies.config import RoutingConfig
from kvgate.policies.cost import prompt_tokens, tokens_per_block
from kvgate.policies.token_rate import HORIZON, MIN_REQUESTS, PromptTokenRates, fleet_rate
from kvgate.policies.prefix_keys import build_request_info
from kvgate.policies.types import RequestInfo
from kvgate.router.gateway import Gateway
from kvgate.router.pipeline import RequestPipeline
from kvgate.simulator import SimFleet, SimOptions
from tests.harness import running_gateway, wait_until


def serve(rates: PromptTokenRates, replica: str, requests: int, chars: int, tokens: int, engine: list[int],
          others: int = 0) -> None:
    """`requests` prompts of `chars` characters and `tokens` tokens answered, and `others` times as many from other
    gateways, then a scrape of the engine's counters (`engine`: requests and tokens so far, updated)."""
    for _ in range(requests):
        rates.answered(replica, chars)
    engine[0] += requests * (1 + others)
    engine[1] += requests * (1 + others) * tokens
    rates.scraped(replica, engine[0], engine[1])


def test_a_replica_rate_is_its_mean_characters_over_its_mean_tokens_once_both_sides_counted_enough() -> None:
    rates, engine = PromptTokenRates(), [500, 90_000]  # what the engine did before this gateway first scraped it
    rates.scraped("a", *engine)
    serve(rates, "a", MIN_REQUESTS - 1, chars=2600, tokens=1000, engine=engine)
    assert rates.rate("a") is None  # too few yet: the configured estimate stands
    serve(rates, "a", 1, chars=2600, tokens=1000, engine=engine)
    assert rates.rate("a") == pytest.approx(2.6)


def test_other_gateways_sending_the_same_mix_to_the_replica_do_not_change_its_rate() -> None:
    rates, engine = PromptTokenRates(), [0, 0]
    rates.scraped("a", *engine)
    serve(rates, "a", 40, chars=3100, tokens=1000, engine=engine, others=2)  # two more gateways behind the Service
    assert rates.rate("a") == pytest.approx(3.1)


def test_an_engine_restart_starts_a_new_baseline_and_keeps_what_was_learned() -> None:
    rates, engine = PromptTokenRates(), [0, 0]
    rates.scraped("a", *engine)
    serve(rates, "a", 40, chars=3000, tokens=1000, engine=engine)
    engine[:] = [0, 0]  # restarted: its counters begin again
    rates.scraped("a", *engine)
    serve(rates, "a", 40, chars=3000, tokens=1000, engine=engine)
    assert rates.rate("a") == pytest.approx(3.0)  # neither a negative step nor the old totals counted against it


def test_the_rate_follows_a_workload_that_changes() -> None:
    rates, engine = PromptTokenRates(), [0, 0]
    rates.scraped("a", *engine)
    serve(rates, "a", HORIZON, chars=4000, tokens=1000, engine=engine)  # English text
    for _ in range(8):
        serve(rates, "a", HORIZON // 2, chars=1500, tokens=1000, engine=engine)  # then mostly another language
    assert rates.rate("a") == pytest.approx(1.5, rel=0.02)


def test_a_model_rate_is_the_median_of_its_replicas_and_unknown_until_one_is_learned() -> None:
    assert fleet_rate([None, None]) is None
    assert fleet_rate([3.0, None, 3.2, 9.0]) == 3.2
    rates = PromptTokenRates()
    rates.scraped("a", 0, 0)
    rates.forget("a")
    assert rates.rate("a") is None


def test_a_learned_rate_counts_the_prompt_and_the_index_blocks_in_the_engine_tokens() -> None:
    config = RoutingConfig()  # 4 characters a token unless learned
    request = RequestInfo(model="m", prompt_chars=6000)
    assert prompt_tokens(request, config) == 1500
    assert prompt_tokens(request.at_rate(2.5), config) == 2400
    assert tokens_per_block(config, request.at_rate(2.5)) == config.block_chars / 2.5
    assert request.at_rate(None) is request


def varied_chats(model: str, count: int) -> list[dict]:
    """`count` chats whose system prompts and questions vary in length."""
    return [{"model": model, "max_tokens": 2, "messages": [
        {"role": "system", "content": "You answer questions about the fleet. " * (1 + i % 5)},
        {"role": "user", "content": f"Question {i}: which replica holds prefix {i * 7919}?"}]} for i in range(count)]


async def engine_chars_per_token(session: aiohttp.ClientSession, engine_url: str, bodies: list[dict]) -> float:
    """The truth a gateway should learn: the mean characters of `bodies`' prompts, as kvgate counts them, over the
    mean prompt tokens the engine counted for them (it must have answered exactly these)."""
    async with session.get(engine_url + "/metrics") as response:
        engine = parse_vllm_metrics(await response.text(), 0.0)
    chars = [build_request_info("chat", body, "interactive", RoutingConfig()).prompt_chars for body in bodies]
    assert engine.finished_requests == len(bodies)
    return (sum(chars) / len(chars)) / (engine.finished_prompt_tokens / engine.finished_requests)


def tokenizing_sim(model_dir: object) -> SimOptions:
    """A simulated engine that tokenizes with the tiny model (under 4 characters a token), fast."""
    return SimOptions(tokenizer=str(model_dir), speed=50.0, max_model_len=2048)


def scraped_metrics(gateway: Gateway) -> ReplicaMetrics:
    """What the gateway last scraped from its one replica."""
    return gateway.fleet.snapshot().endpoints[0].metrics


async def learned_as_the_engine_counted(gateway: Gateway, session: aiohttp.ClientSession, engine_url: str,
                                        model: str, bodies: list[dict]) -> float:
    """Once the gateway has scraped the engine's count of `bodies`, its rate for `model` must be the engine's own,
    well under the 4 assumed; returns it."""
    truth = await engine_chars_per_token(session, engine_url, bodies)
    await wait_until(lambda: scraped_metrics(gateway).finished_requests == len(bodies))
    assert gateway.fleet.chars_per_token(model) == pytest.approx(truth) and truth < 3.5
    return truth


async def test_a_gateway_learns_the_characters_per_token_its_engine_counts_and_routes_with_them(tiny_model_dir):
    # The simulated engine tokenizes with the tiny model (under 4 characters a token); the gateway has no tokenizer.
    model = "meta-llama/Llama-3.1-8B-Instruct"
    fleet = await SimFleet.start([0], tokenizing_sim(tiny_model_dir))
    try:
        async with running_gateway(endpoints=fleet.urls[0], scrape_interval=0.05, scrape_timeout=0.04) as gw, \
                aiohttp.ClientSession() as session:
            bodies = varied_chats(model, MIN_REQUESTS + 8)
            await wait_until(lambda: scraped_metrics(gw.gateway).finished_requests == 0)  # counted from the start
            for body in bodies:
                async with session.post(gw.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
            truth = await learned_as_the_engine_counted(gw.gateway, session, fleet.urls[0], model, bodies)
            async with session.get(gw.url + "/debug/fleet") as response:
                assert (await response.json())["endpoints"][0]["chars_per_token"] == pytest.approx(truth, abs=1e-3)
            async with session.get(gw.url + "/metrics") as response:
                assert "kvgate_replica_chars_per_token{" in await response.text()
            request = await RequestPipeline(gw.gateway).read("/v1/chat/completions", {}, orjson.dumps(bodies[0]), None)
            chars = build_request_info("chat", bodies[0], "interactive", RoutingConfig()).prompt_chars
            assert prompt_tokens(request.info, RoutingConfig()) == round(chars / truth)  # the engine's count
    finally:
        await fleet.stop()
