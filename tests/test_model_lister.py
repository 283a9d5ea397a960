"""ModelLister against real aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvgate.endpoints.model_lister import ModelLister, model_ids
from tests.fake_vllm_replica import models_payload, refused_endpoint
from tests.harness import wait_until

BASE = "meta-llama/Llama-3.1-8B-Instruct"


async def test_lists_base_models_and_lora_adapters_of_every_endpoint(session, start_replica):
    with_lora = await start_replica(models=models_payload((BASE, None), ("sql-lora", BASE), ("chat-lora", BASE)))
    other = await start_replica(models=models_payload(("Qwen/Qwen3-32B", None)))
    lister = ModelLister(lambda: session)
    lister.set_endpoints([with_lora.endpoint, other.endpoint])

    await lister.refresh_once()

    assert lister.models(with_lora.endpoint.key) == frozenset({BASE, "sql-lora", "chat-lora"})
    assert lister.models(other.endpoint.key) == frozenset({"Qwen/Qwen3-32B"})
    assert lister.models("never-listed") == frozenset()


def test_adapter_parent_counts_even_when_the_base_card_is_missing():
    assert model_ids(models_payload(("sql-lora", BASE))) == frozenset({"sql-lora", BASE})


@pytest.mark.parametrize("payload", [{"object": "list"}, {"data": "oops"}, {"data": [{"name": "x"}]}, []])
def test_unexpected_payload_shape_is_an_error(payload):
    with pytest.raises(ValueError, match="shape"):
        model_ids(payload)


async def test_failed_listing_keeps_the_previous_models_and_logs_once(session, start_replica, caplog):
    replica = await start_replica(models=models_payload((BASE, None), ("sql-lora", BASE)))
    lister = ModelLister(lambda: session)
    lister.set_endpoints([replica.endpoint])
    await lister.refresh_once()
    caplog.set_level(logging.WARNING, logger="kvgate.endpoints")

    replica.status = 500
    await lister.refresh_once()
    replica.status, replica.models = 200, {"data": "not a list of cards"}
    await lister.refresh_once()

    assert lister.models(replica.endpoint.key) == frozenset({BASE, "sql-lora"})
    assert [record.getMessage().split(" endpoint=")[0] for record in caplog.records] == ["model listing failing"]


async def test_unreachable_endpoint_has_no_models(session):
    endpoint = refused_endpoint()
    lister = ModelLister(lambda: session)
    lister.set_endpoints([endpoint])

    await lister.refresh_once()

    assert lister.models(endpoint.key) == frozenset()


async def test_run_lists_new_endpoints_right_away_then_every_refresh(session, start_replica):
    first = await start_replica(models=models_payload((BASE, None)))
    lister = ModelLister(lambda: session, refresh_s=1.0)
    lister.set_endpoints([first.endpoint])
    task = asyncio.create_task(lister.run())
    try:
        await wait_until(lambda: lister.models(first.endpoint.key) == {BASE}, timeout=0.5)
        second = await start_replica(models=models_payload(("Qwen/Qwen3-32B", None)))
        lister.set_endpoints([first.endpoint, second.endpoint])
        await wait_until(lambda: bool(lister.models(second.endpoint.key)), timeout=0.5)  # not after refresh_s
        first.models = models_payload((BASE, None), ("sql-lora", BASE))
        await wait_until(lambda: "sql-lora" in lister.models(first.endpoint.key), timeout=3.0)
    finally:
        task.cancel()
    assert second.hits["/v1/models"] <= 2  # refreshed on its own schedule, not on every wake-up


async def test_run_retries_a_failed_listing_sooner_than_the_refresh(session, start_replica):
    loading = await start_replica(status=503)  # vLLM still loading its model
    lister = ModelLister(lambda: session, refresh_s=30.0, retry_s=0.05)
    lister.set_endpoints([loading.endpoint])
    task = asyncio.create_task(lister.run())
    try:
        await wait_until(lambda: loading.hits["/v1/models"] >= 1)
        loading.status = 200
        await wait_until(lambda: lister.models(loading.endpoint.key) == {BASE}, timeout=1.0)
    finally:
        task.cancel()


async def test_removed_endpoint_is_forgotten_and_no_longer_listed(session, start_replica):
    replica = await start_replica()
    lister = ModelLister(lambda: session, refresh_s=0.05)
    lister.set_endpoints([replica.endpoint])
    task = asyncio.create_task(lister.run())
    try:
        await wait_until(lambda: replica.hits["/v1/models"] >= 2)
        lister.set_endpoints([])
        await asyncio.sleep(0.1)  # a listing already on the wire may still land
        hits_after_removal = replica.hits["/v1/models"]
        await asyncio.sleep(0.2)
    finally:
        task.cancel()
    assert replica.hits["/v1/models"] == hits_after_removal
    assert lister.models(replica.endpoint.key) == frozenset()
