"""What kvgate's routing cost assumes of vLLM's scheduler, checked on a real engine."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.real.conftest import MODEL
from tests.real.engine_view import paused, scheduling_steps, send_in_order

pytestmark = pytest.mark.timeout(300)


async def test_a_request_that_fits_waits_behind_one_whose_kv_blocks_are_not_free(fresh_engines):
    """vLLM admits its queue first come first served and stops at the first request it cannot give KV blocks: a
    two-block request queued behind a sixteen-block one waits with it, though it would fit at once.

    kvgate's routing cost counts a replica's whole queue ahead of a new request for this reason (docs/routing.md).
    Two 2,048-token prompts with 300-token answers come to hold 34 to 38 of the engine's 48 blocks; the third
    prompt needs 16 blocks, the fourth 2. All four are queued in the paused engine, in that order, and the order
    they were scheduled in is read from its KV events.
    """
    engine = fresh_engines[0]
    lengths = {"holder0": (2048, 300), "holder1": (2048, 300), "blocked": (2000, 4), "small": (200, 4)}
    prompts = {name: [100 + k] + [(37 * k + 11 * j) % 3800 + 150 for j in range(prompt - 1)]
               for k, (name, (prompt, _)) in enumerate(lengths.items())}
    requests = [({"model": MODEL, "prompt": prompts[name], "max_tokens": answer, "stream": True, "ignore_eos": True},
                 {}) for name, (_, answer) in lengths.items()]
    async with aiohttp.ClientSession() as session:
        async with paused(session, engine):
            tasks = await send_in_order(session, engine.url + "/v1/completions", requests)
        statuses = await asyncio.gather(*tasks)
        scheduled = await scheduling_steps(engine, {tuple(ids[:128]): name for name, ids in prompts.items()})
    assert set(statuses) == {200}, statuses
    assert scheduled.keys() == lengths.keys(), scheduled
    assert scheduled["blocked"] > scheduled["holder1"] + 1, scheduled  # it waited while the holders decoded
    assert scheduled["small"] >= scheduled["blocked"], scheduled  # and the small one waited with it
