"""Precise routing against real vLLM engines with KV events: tokenization, belief, restarts (issue #15).

The engines (tests/real/conftest.py) publish on `tcp://127.0.0.1:PORT`, an endpoint without `*`, so vLLM
connects out to it: kvgate binds those addresses (`kv_events_bind`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kvgate.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.engine.tokenizer import EngineTokenizer
from kvgate.loadtest.kit.vllm_engine import VllmEngine
from tests.harness import running_gateway, wait_until
from tests.real.conftest import MODEL
from tests.real.engine_view import engine_tokens, replayed_batches
from tests.real.test_through_kvgate import SYSTEM, chat, engine_samples

pytestmark = pytest.mark.timeout(600)

CHATS = [
    chat(1, ["What is the refund policy?"]),
    chat(2, ["First question.", "Second question, after an answer."]),
    {**chat(3, ["No generation prompt."]), "add_generation_prompt": False},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Parts "},
                                                                {"type": "text", "text": "joined."}]}]},
    {**chat(4, ["Which tool?"]), "tools": [{"type": "function", "function": {
        "name": "lookup", "description": "Find a policy section", "parameters": {"type": "object", "properties": {
            "section": {"type": "string"}}}}}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "Unicode: naïve café 東京 🚀 and\ttabs\n\nnewlines"}]},
]
PROMPTS = ["def main():\n    return 0\n", "Plain text prompt with ünïcödé.", "  leading spaces", ""]


def event_settings(engines: list[VllmEngine], model_dir: Path) -> dict:
    return {"endpoints": [e.url for e in engines], "kv_events_bind": True,
            "kv_events_endpoint": [f"{e.url}={e.kv_events_endpoint}" for e in engines],
            "kv_events_replay_endpoint": [f"{e.url}={e.replay_endpoint}" for e in engines],
            "tokenizer": [f"{MODEL}={model_dir}"], "scrape_interval": 0.1}


async def test_tokenization_equals_the_engines_tokenize_on_chats_and_prompts(fresh_engines, model_dir):
    tokenizer = EngineTokenizer.load(model_dir)
    async with aiohttp.ClientSession() as session:
        for body in CHATS:
            engine_ids = await engine_tokens(session, fresh_engines[0], {k: v for k, v in body.items()
                                                                          if k != "max_tokens"})
            assert tokenizer.chat_ids(body) == engine_ids, body
        for prompt in PROMPTS:
            engine_ids = await engine_tokens(session, fresh_engines[0], {"model": MODEL, "prompt": prompt})
            assert tokenizer.completion_ids({"prompt": prompt}) == engine_ids, prompt
        ids = [5, 6, 7, 8]
        assert tokenizer.completion_ids({"prompt": ids}) == ids


async def replayed_state(engine: VllmEngine) -> set:
    """What the engine stored minus what it removed, from every batch its replay buffer holds (from seq 0)."""
    held: set = set()
    batches = await replayed_batches(engine)
    assert [batch.seq for batch in batches] == list(range(len(batches))), \
        "the replay buffer no longer reaches back to the engine's start"
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
    return held


async def test_belief_matches_what_the_engine_stored_minus_what_it_removed_after_evictions(fresh_engines, model_dir):
    engine = fresh_engines[0]
    async with running_gateway(**event_settings(fresh_engines, model_dir)) as gw, aiohttp.ClientSession() as session:
        precise = gw.gateway.precise
        await wait_until(lambda: precise.is_precise(engine.url), timeout=30)
        for tenant in range(30):  # 30 prompts of ~900 tokens against 48 blocks of 128 tokens: constant eviction
            async with session.post(engine.url + "/v1/chat/completions", json=chat(100 + tenant, ["Hello."])) as r:
                assert r.status == 200, await r.text()
        truth: set = set()

        async def settled() -> bool:
            truth.clear()
            truth.update(await replayed_state(engine))
            return precise.engine_hashes(engine.url) == truth

        deadline = asyncio.get_running_loop().time() + 20
        while not await settled():
            assert asyncio.get_running_loop().time() < deadline, (len(truth), precise.blocks_held(engine.url))
            await asyncio.sleep(0.2)
        stats = gw.gateway.kv_events.stats()[engine.url]
        assert precise.is_precise(engine.url) and stats.events > 0
        assert 0 < len(truth) <= 48  # at most the engine's whole cache, though ~200 blocks were stored: evictions


async def completed(session: aiohttp.ClientSession, engine: VllmEngine) -> float:
    return (await engine_samples(session, engine)).get("vllm:request_success_total", 0.0)


async def test_after_an_engine_restart_no_request_is_routed_there_for_a_prefix_it_lost(fresh_engines, model_dir):
    prompt = SYSTEM.format(n=7)  # ~900 tokens: several 128-token blocks
    async with running_gateway(**event_settings(fresh_engines, model_dir)) as gw, aiohttp.ClientSession() as session:
        precise = gw.gateway.precise
        await wait_until(lambda: all(precise.is_precise(e.url) for e in fresh_engines), timeout=30)
        for engine in fresh_engines:  # both engines hold the prefix, and kvgate sees it in their events
            async with session.post(engine.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": prompt + " warm", "max_tokens": 1}) as r:
                assert r.status == 200
        await wait_until(lambda: all(precise.blocks_held(e.url) >= 7 for e in fresh_engines), timeout=20)
        restarted, survivor = fresh_engines
        await asyncio.to_thread(restarted.restart)
        # One event round trip: the dropped connection cleared its state; the new engine is precise and empty.
        await wait_until(lambda: precise.is_precise(restarted.url) and precise.blocks_held(restarted.url) == 0,
                         timeout=30)
        before = [await completed(session, e) for e in fresh_engines]
        for number in range(6):
            async with session.post(gw.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": f"{prompt} question {number}",
                                          "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
        after = [await completed(session, e) for e in fresh_engines]
        assert after[0] - before[0] == 0 and after[1] - before[1] == 6
