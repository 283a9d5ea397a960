"""What kvgate's routing cost and its simulator assume of vLLM's scheduler, checked on a real engine."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.loadtest.kit.vllm_engine import VllmEngine
from kvgate.simulator import SimOptions
from kvgate.simulator.scheduler import EngineCore, Sequence
from kvgate.simulator.tokens import TokenSeq
from tests.real.conftest import MODEL
from tests.real.engine_view import paused, replayed_batches, scheduling_steps, send_in_order
from tests.real.test_through_kvgate import chat

pytestmark = pytest.mark.timeout(300)


def distinct_prompts(lengths: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """Per name, a prompt of token ids of its length (prompt, answer), each with its own first block."""
    return {name: [100 + k] + [(37 * k + 11 * j) % 3800 + 150 for j in range(prompt - 1)]
            for k, (name, (prompt, _)) in enumerate(lengths.items())}


async def queued_then_scheduled(engine: VllmEngine, lengths: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Queue streamed completions of these lengths in the paused engine, in order, and resume it; per name, the KV
    event batch its first block was stored in, once every answer is read (each must be 200)."""
    prompts = distinct_prompts(lengths)
    requests = [({"model": MODEL, "prompt": prompts[name], "max_tokens": answer, "stream": True, "ignore_eos": True},
                 {}) for name, (_, answer) in lengths.items()]
    async with aiohttp.ClientSession() as session:
        async with paused(session, engine):
            tasks = await send_in_order(session, engine.url + "/v1/completions", requests)
        statuses = await asyncio.gather(*tasks)
        scheduled = await scheduling_steps(engine, {tuple(ids[:128]): name for name, ids in prompts.items()})
    assert set(statuses) == {200}, statuses
    assert scheduled.keys() == lengths.keys(), scheduled
    return scheduled


async def test_a_request_that_fits_waits_behind_one_whose_kv_blocks_are_not_free(fresh_engines):
    """vLLM admits its queue first come first served and stops at the first request it cannot give KV blocks: a
    two-block request queued behind a sixteen-block one waits with it, though it would fit at once.

    kvgate's routing cost counts a replica's whole queue ahead of a new request for this reason (docs/routing.md).
    Two 2,048-token prompts with 300-token answers come to hold 34 to 38 of the engine's 48 blocks; the third
    prompt needs 16 blocks, the fourth 2. All four are queued in the paused engine, in that order, and the order
    they were scheduled in is read from its KV events.
    """
    lengths = {"holder0": (2048, 300), "holder1": (2048, 300), "blocked": (2000, 4), "small": (200, 4)}
    scheduled = await queued_then_scheduled(fresh_engines[0], lengths)
    assert scheduled["blocked"] > scheduled["holder1"] + 1, scheduled  # it waited while the holders decoded
    assert scheduled["small"] >= scheduled["blocked"], scheduled  # and the small one waited with it


async def test_a_full_cache_evicts_as_much_as_it_stores_and_never_before_it_is_full(fresh_engines):
    """Prefix caching keeps a finished request's blocks cached until their space is needed: nothing is evicted while
    the cache has room, and once it is full every store evicts as many blocks as it stores.

    kvgate prices a request moved off the replica holding its context with the evictions its second copy causes
    (policies/cost.py, `duplicated`); that holds because a turned-over cache is always full.
    """
    engine = fresh_engines[0]
    async with aiohttp.ClientSession() as session:
        for tenant in range(20):  # 20 distinct prompts of ~900 tokens (7 blocks of 128) against 48 blocks
            async with session.post(engine.url + "/v1/chat/completions",
                                    json=chat(200 + tenant, ["Hello."], max_tokens=2)) as response:
                assert response.status == 200, await response.text()
    events = [event for batch in await replayed_batches(engine) for event in batch.events]
    since_reset = len(events) - next(i for i, event in enumerate(reversed(events)) if isinstance(event, AllBlocksCleared))
    held, history, first_removal = 0, [], None
    for event in events[since_reset:]:
        if isinstance(event, BlockStored):
            held += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            if first_removal is None:
                first_removal = held
            held -= len(event.block_hashes)
        history.append((held, first_removal is not None))
    peak = max(count for count, _ in history)
    per_prompt = 8  # blocks one request stores, at most
    assert first_removal is not None and peak <= 48
    assert first_removal >= peak - per_prompt  # nothing evicted while there was room
    assert min(count for count, evicting in history if evicting) >= peak - 2 * per_prompt  # the cache stays full
    assert held >= peak - per_prompt


async def test_a_prompt_longer_than_the_token_budget_is_prefilled_over_steps_as_the_simulator_does(fresh_engines):
    """vLLM computes at most `max_num_batched_tokens` tokens a step (2,048 on CPU) and prefills a longer prompt in
    chunks, storing each chunk's full blocks in its own step. The simulator, given the same budget, must store the
    same blocks in the same steps: a 4,000-token prompt is 16 blocks of 128, then 15."""
    engine = fresh_engines[0]
    prompt = [100] + [(13 * j) % 3800 + 150 for j in range(3999)]
    async with aiohttp.ClientSession() as session:
        async with session.post(engine.url + "/v1/completions",
                                json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as response:
            assert response.status == 200, await response.text()
    batches = await replayed_batches(engine)
    reset = max(i for i, batch in enumerate(batches) if any(isinstance(e, AllBlocksCleared) for e in batch.events))
    # The reset's event goes out with the first step after it, in one batch.
    engine_steps = [stored for batch in batches[reset:]
                    if (stored := sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored)))]

    core = EngineCore(SimOptions(max_num_batched_tokens=2048, block_size=128, num_gpu_blocks=48, max_model_len=4096))
    seq = Sequence(tokens=TokenSeq.from_ids(prompt), max_tokens=2, arrival_time=0.0)
    core.add(seq)
    sim_steps = []
    while not seq.output_ids:
        stored_before = seq.settled_blocks
        core.schedule()
        sim_steps.append(seq.settled_blocks - stored_before)
        core.complete_step(now=0.0)
    assert engine_steps == sim_steps == [16, 15]


async def test_a_prompt_is_admitted_once_blocks_for_all_of_it_are_free_as_the_simulator_does(fresh_engines):
    """vLLM 0.32 prefills a long prompt a chunk at a time, but admits it only once blocks for all of it are free
    (`--scheduler-reserve-full-isl`, its default), as the simulator does. A 4,000-token prompt (32 blocks of 128)
    queued behind a 2,048-token one answering 300 tokens (17 to 19 of the 48 blocks) waits for that one to finish,
    though its first chunk (16 blocks) would fit at once. kvgate's KV room counts whole prompts for this reason."""
    lengths = {"holder": (2048, 300), "long": (4000, 4)}
    scheduled = await queued_then_scheduled(fresh_engines[0], lengths)
    # The holder stores a block at its 2,176th and 2,304th tokens while it decodes: two batches between them.
    assert scheduled["long"] > scheduled["holder"] + 1, scheduled

    core = EngineCore(SimOptions(max_num_batched_tokens=2048, block_size=128, num_gpu_blocks=48, max_model_len=4096))
    prompts = distinct_prompts(lengths)
    holder, long = (Sequence(tokens=TokenSeq.from_ids(prompts[name]), max_tokens=lengths[name][1], arrival_time=0.0)
                    for name in lengths)
    core.add(holder)
    core.add(long)
    steps = 0
    while long.num_computed == 0:
        core.schedule()
        core.complete_step(now=float(steps))
        steps += 1
    assert holder.finished and steps == 301  # the holder's prefill and 299 more tokens, then the long prompt


async def test_requests_sharing_a_prefix_hold_its_blocks_once_as_the_simulator_does(fresh_engines):
    """vLLM holds a prompt block once however many running requests share it, as kvgate's KV accounting counts it
    (policies/held_kv.py). Two requests share a 2,048-token prefix (16 blocks of 128), each with 256 tokens of its
    own and a 300-token answer: together they come to hold 16 + 2 x (2 + 3) = 26 of the 48 blocks, so a distinct
    2,000-token prompt (16 blocks) is admitted beside them at once. Held twice, they would hold 40 to 42 blocks and
    it would wait for one to finish, as a prompt does behind two distinct ones (the test above)."""
    engine = fresh_engines[0]
    prefix = [100] + [(13 * j) % 3800 + 150 for j in range(2047)]
    first, second = (prefix + [(7 * j + 29 * k) % 3800 + 150 for j in range(256)] for k in (1, 2))
    distinct = [101] + [(37 * j) % 3800 + 150 for j in range(1999)]

    def body(prompt: list[int], answer: int) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": answer, "stream": True, "ignore_eos": True}

    async with aiohttp.ClientSession() as session:
        first_token = asyncio.Event()

        async def stream_first() -> int:
            async with session.post(engine.url + "/v1/completions", json=body(first, 300)) as response:
                await response.content.readline()
                first_token.set()  # its prompt is prefilled and its blocks cached: the second finds them
                await response.read()
                return response.status

        holder = asyncio.create_task(stream_first())
        await asyncio.wait_for(first_token.wait(), timeout=60)
        async with paused(session, engine):
            tasks = await send_in_order(session, engine.url + "/v1/completions",
                                        [(body(second, 300), {}), (body(distinct, 4), {})])
        statuses = await asyncio.gather(holder, *tasks)
        scheduled = await scheduling_steps(engine, {tuple(second[2048:2176]): "second",
                                                    tuple(distinct[:128]): "distinct"})
    assert set(statuses) == {200}, statuses
    assert scheduled.keys() == {"second", "distinct"}, scheduled
    assert scheduled["distinct"] <= scheduled["second"] + 2, scheduled  # in the steps that prefill the second

    core = EngineCore(SimOptions(max_num_batched_tokens=2048, block_size=128, num_gpu_blocks=48, max_model_len=4096))
    sequences = [Sequence(tokens=TokenSeq.from_ids(prompt), max_tokens=answer, arrival_time=0.0)
                 for prompt, answer in ((first, 300), (second, 300), (distinct, 4))]
    core.add(sequences[0])
    while not sequences[0].output_ids:
        core.schedule()
        core.complete_step(now=0.0)
    core.add(sequences[1])
    core.add(sequences[2])
    steps = 0
    while sequences[2].num_computed == 0:
        core.schedule()
        core.complete_step(now=float(steps))
        steps += 1
    assert steps <= 2 and not sequences[0].finished
