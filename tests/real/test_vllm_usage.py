"""What the simulator's answers say of each request's prompt cache, checked against a real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.simulator import SimFleet, SimOptions
from tests.real.conftest import MODEL
from tests.test_simulator import usage_of

pytestmark = pytest.mark.timeout(300)

PROMPT = [100] + [(11 * j) % 3800 + 150 for j in range(299)]  # token ids: two full blocks of 128 and 44 more
CHAT = {"messages": [{"role": "user", "content": "Where is my order? " * 30}]}
# Each request's path and body, in order: the cache each one finds is what the ones before it left.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/completions", {"prompt": PROMPT + [7] * 200}),  # holds the first prompt's two blocks
    ("/v1/completions", {"prompt": PROMPT + [7] * 205, "stream": True}),  # and the second's third
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
]


async def usages(url: str) -> list[dict[str, Any]]:
    """The usage of each request in turn."""
    async with aiohttp.ClientSession() as session:
        return [await usage_of(session, url, path, body, {"model": MODEL, "max_tokens": 3, "ignore_eos": True})
                for path, body in REQUESTS]


async def test_prompt_tokens_details_match_the_engines(fresh_engines, model_dir: Path):
    """With --enable-prompt-tokens-details an answer's usage tells how many prompt tokens were found cached (and, for
    chats, how many it cached anew); the simulator, given the engine's block size and tokenizer, says the same,
    field for field, nulls and left-out fields included: what the chats benchmark reads to say where misses fall."""
    engine_usages = await usages(fresh_engines[0].url)
    sim = await SimFleet.start([0], SimOptions(models=(MODEL,), tokenizer=str(model_dir), block_size=128,
                                               max_model_len=4096, speed=20.0, enable_prompt_tokens_details=True))
    try:
        sim_usages = await usages(sim.urls[0])
    finally:
        await sim.stop()
    assert [usage["prompt_tokens_details"]["cached_tokens"] for usage in engine_usages] == [0, 256, 384, 0, 128]
    assert sim_usages == engine_usages
