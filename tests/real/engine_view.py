"""What a real engine itself says (its tokenization, the KV event batches its replay buffer holds), and its pause."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import aiohttp

from kvgate.engine.kv_events import BlockStored, EventBatch, decode_batch, replay
from kvgate.loadtest.kit.vllm_engine import VllmEngine


async def engine_tokens(session: aiohttp.ClientSession, engine: VllmEngine, body: dict) -> list[int]:
    """The token ids the engine's `/tokenize` gives a chat or completions body."""
    async with session.post(engine.url + "/tokenize", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["tokens"]


async def replayed_batches(engine: VllmEngine) -> list[EventBatch]:
    """Every KV event batch the engine's replay buffer holds, oldest first, asked for from seq 0."""
    return [decode_batch(seq, payload) async for seq, payload in replay(engine.replay_endpoint, 0, timeout_s=10)]


@asynccontextmanager
async def paused(session: aiohttp.ClientSession, engine: VllmEngine) -> AsyncIterator[None]:
    """The engine's scheduler paused with vLLM's own `POST /pause?mode=keep` (dev mode) until the block exits.

    Requests added meanwhile wait in its queue; on `/resume`, which reaches the engine after them on the same
    channel, it schedules them as its policy orders them, whatever the machine's speed.
    """
    async with session.post(engine.url + "/pause", params={"mode": "keep"}) as response:
        assert response.status == 200, await response.text()
    try:
        yield
    finally:
        async with session.post(engine.url + "/resume") as response:
            assert response.status == 200, await response.text()


async def scheduling_steps(engine: VllmEngine, first_blocks: Mapping[tuple[int, ...], str]) -> dict[str, int]:
    """For each request named by its prompt's first block of token ids, the seq of the event batch that stored it.

    A prompt's first full block is stored in the step that prefills it, so these order the requests as the
    engine's scheduler took them, read from the engine and not from when their answers reached a client.
    """
    block = len(next(iter(first_blocks)))
    return {first_blocks[event.token_ids[:block]]: batch.seq for batch in await replayed_batches(engine)
            for event in batch.events
            if isinstance(event, BlockStored) and event.token_ids[:block] in first_blocks}


async def send_in_order(session: aiohttp.ClientSession, url: str,
                        requests: Sequence[tuple[dict, Mapping[str, str]]]) -> list[asyncio.Task[int]]:
    """Start streamed requests (body, headers) one at a time, each once the one before was answered with headers.

    vLLM adds a streamed request to its engine as it starts the body, right after its headers, so the engine
    queues them in this order. Each task reads its whole answer and returns its status.
    """
    async def stream(body: dict, headers: Mapping[str, str], added: asyncio.Event) -> int:
        async with session.post(url, json=body, headers=headers) as response:
            added.set()
            await response.read()
            return response.status

    tasks = []
    for body, headers in requests:
        added = asyncio.Event()
        tasks.append(asyncio.create_task(stream(body, headers, added)))
        await asyncio.wait_for(added.wait(), timeout=30)
    return tasks
