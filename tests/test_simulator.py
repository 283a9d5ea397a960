"""The vLLM simulator behaves like vLLM's OpenAI server: shapes, errors, metrics, caching, scheduling, lifecycle."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.simulator import SimFleet, SimOptions, add_sim_arguments, sim_options_from_args
from kvgate.simulator.scheduler import EngineCore, Sequence
from kvgate.simulator.tokens import TokenSeq
from tests.metrics_shape import REAL_PAGE, vllm_family_shapes

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FAST = {"speed": 20.0, "max_model_len": 4096}

StartFleet = Callable[..., Awaitable[SimFleet]]


@pytest.fixture
async def start_fleet() -> AsyncIterator[StartFleet]:
    fleets: list[SimFleet] = []

    async def start(replicas: int = 1, **overrides: Any) -> SimFleet:
        fleet = await SimFleet.start([0] * replicas, SimOptions(**(FAST | overrides)))
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        await fleet.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        yield client


def text_of_tokens(num_tokens: int, seed: str = "a") -> str:
    """A prompt of exactly `num_tokens` simulator tokens (4 characters each)."""
    return (seed * 4 * num_tokens)[: 4 * num_tokens]


async def read_events(response: aiohttp.ClientResponse) -> list[bytes]:
    """The `data:` payloads of an SSE body, checking the framing."""
    body = await response.read()
    assert body.endswith(b"data: [DONE]\n\n")
    events = body.split(b"\n\n")
    assert events[-1] == b""
    assert all(event.startswith(b"data: ") for event in events[:-1])
    return [event[len(b"data: ") :] for event in events[:-1]]


async def stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/sim/stats") as response:
        return await response.json()


async def metric_samples(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, frozenset], float]:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def wait_for(condition: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def complete(session: aiohttp.ClientSession, url: str, prompt: Any, **fields: Any) -> dict[str, Any]:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 1} | fields
    async with session.post(f"{url}/v1/completions", json=payload) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def cache_hits_of(session: aiohttp.ClientSession, url: str, prompt: Any) -> int:
    """Prefix-cache hit tokens counted for one completion of `prompt`."""
    before = await stats(session, url)
    await complete(session, url, prompt)
    after = await stats(session, url)
    return after["prefix_cache_hits"] - before["prefix_cache_hits"]


async def test_models_list_served_names_with_max_model_len_and_lora_parents(start_fleet, session):
    fleet = await start_fleet(models=(MODEL, "llama"), lora_adapters=("sql-lora",))
    async with session.get(f"{fleet.urls[0]}/v1/models") as response:
        body = await response.json()
    assert body["object"] == "list"
    cards = {card["id"]: card for card in body["data"]}
    assert list(cards) == [MODEL, "llama", "sql-lora"]
    assert cards[MODEL]["parent"] is None and cards[MODEL]["max_model_len"] == 4096
    assert cards["llama"]["root"] == MODEL and cards["llama"]["owned_by"] == "vllm"
    assert cards["sql-lora"]["parent"] == MODEL


async def test_health_is_200_with_empty_body(start_fleet, session):
    fleet = await start_fleet()
    async with session.get(f"{fleet.urls[0]}/health") as response:
        assert response.status == 200
        assert await response.read() == b""


async def test_openai_sdk_streams_chat_with_usage(start_fleet):
    fleet = await start_fleet()
    client = openai.AsyncOpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="unused")
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello"}],
            max_completion_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert len(text.split()) == 5


async def test_streaming_chat_frames_role_chunk_tokens_and_done(start_fleet, session):
    fleet = await start_fleet()
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with session.post(f"{fleet.urls[0]}/v1/chat/completions", json=payload) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        assert response.headers["X-Accel-Buffering"] == "no"
        events = await read_events(response)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" and "usage" not in chunk for chunk in chunks)
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[1:]] == [None, None, "length"]


async def test_include_usage_adds_a_last_chunk_without_choices(start_fleet, session):
    fleet = await start_fleet()
    payload = {
        "model": MODEL,
        "prompt": text_of_tokens(40),
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(f"{fleet.urls[0]}/v1/completions", json=payload) as response:
        events = await read_events(response)
    last = orjson.loads(events[-2])
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 40, "total_tokens": 44, "completion_tokens": 4}  # nulls left out
    assert orjson.loads(events[0])["choices"][0]["text"].strip()  # completions have no role chunk


async def usage_of(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                   base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The usage an answer to `body` (over `base`: this simulator's model, 2 tokens) reports: the whole answer's, or a
    stream's last chunk's."""
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
    async with session.post(url + path, json={**(base or {"model": MODEL, "max_tokens": 2}), **body}) as response:
        assert response.status == 200, await response.text()
        if not body.get("stream"):
            return (await response.json())["usage"]
        return orjson.loads((await read_events(response))[-2])["usage"]


async def test_prompt_tokens_details_count_the_cached_prompt_tokens_and_for_chats_those_newly_cached(
        start_fleet, session):
    """vLLM's --enable-prompt-tokens-details: a request's cached prompt tokens when first scheduled (whole blocks, the
    last token always computed), and for chats the tokens of the whole blocks it then cached anew; a stream's usage
    chunk leaves nulls out (tests/real/test_vllm_usage.py holds a real engine to the same)."""
    fleet = await start_fleet(enable_prompt_tokens_details=True)
    url, prompt = fleet.urls[0], [100 + k for k in range(40)]  # two full blocks of 16 and 8 tokens more
    first = await usage_of(session, url, "/v1/completions", {"prompt": prompt})
    assert first["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                              "multimodal_tokens": None}
    assert first["completion_tokens_details"] is None
    longer = await usage_of(session, url, "/v1/completions", {"prompt": prompt + [7] * 10, "stream": True})
    assert longer["prompt_tokens_details"] == {"cached_tokens": 32}
    chat = {"messages": [{"role": "user", "content": text_of_tokens(50, "c")}]}
    whole = await usage_of(session, url, "/v1/chat/completions", chat)
    blocks = whole["prompt_tokens"] // 16
    assert whole["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 16 * blocks,
                                              "multimodal_tokens": None}
    again = await usage_of(session, url, "/v1/chat/completions", {**chat, "stream": True})
    cached = 16 * ((whole["prompt_tokens"] - 1) // 16)
    assert again["prompt_tokens_details"] == {"cached_tokens": cached, "created_cache_tokens": 16 * blocks - cached}
    plain = await start_fleet()
    assert (await usage_of(session, plain.urls[0], "/v1/completions", {"prompt": prompt}))["prompt_tokens_details"] \
        is None


async def test_non_streamed_chat_has_message_finish_reason_and_usage(start_fleet, session):
    fleet = await start_fleet()
    payload = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "describe"}]}],
        "max_tokens": 7,
        "max_completion_tokens": 2,
    }
    async with session.post(
        f"{fleet.urls[0]}/v1/chat/completions", json=payload, headers={"X-Request-Id": "abc"}
    ) as response:
        body = await response.json()
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 2
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


async def test_completions_accept_token_ids_and_prompt_lists(start_fleet, session):
    fleet = await start_fleet()
    body = await complete(session, fleet.urls[0], [[1, 2, 3], [4, 5]], max_tokens=2)
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4


async def test_embeddings_return_one_vector_per_input(start_fleet, session):
    fleet = await start_fleet()
    async with session.post(
        f"{fleet.urls[0]}/v1/embeddings", json={"model": MODEL, "input": ["one", "two"]}
    ) as response:
        body = await response.json()
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert body["data"][0]["embedding"] != body["data"][1]["embedding"]
    assert body["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize(
    ("path", "payload", "status", "error_type", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
            "NotFoundError",
            "model",
        ),
        ("/v1/chat/completions", {"model": MODEL}, 400, "BadRequestError", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "BadRequestError", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "BadRequestError", None),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "BadRequestError",
            None,
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "priority": 5}, 400, "BadRequestError", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "BadRequestError", None),
    ],
    ids=[
        "unknown-model",
        "missing-messages",
        "messages-wrong-type",
        "max-tokens-wrong-type",
        "include-usage-without-stream",
        "priority-not-enabled",
        "context-overflow",
    ],
)
async def test_invalid_requests_get_openai_error_shapes(start_fleet, session, path, payload, status, error_type, param):
    fleet = await start_fleet()
    async with session.post(f"{fleet.urls[0]}{path}", json=payload) as response:
        body = await response.json()
        assert response.status == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type and body["error"]["code"] == status and body["error"]["param"] == param
    assert (await stats(session, fleet.urls[0]))["requests"] == 0


async def test_priority_is_accepted_with_priority_scheduling(start_fleet, session):
    fleet = await start_fleet(priority_scheduling=True)
    body = await complete(session, fleet.urls[0], "x", priority=5)
    assert body["choices"][0]["finish_reason"] == "length"


async def test_metrics_page_has_vllm_names_and_sorted_labels(start_fleet, session):
    fleet = await start_fleet(legacy_cache_metric=True, lora_adapters=("sql-lora",), num_gpu_blocks=512)
    await complete(session, fleet.urls[0], text_of_tokens(64), model="sql-lora")
    samples = await metric_samples(session, fleet.urls[0])
    engine = frozenset({("engine", "0"), ("model_name", MODEL)})
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        assert samples[(name, engine)] == 0.0
    assert samples[("vllm:prefix_cache_queries_total", engine)] == 64.0
    assert samples[("vllm:request_success_total", engine | {("finished_reason", "length")})] == 1.0
    assert samples[("vllm:time_to_first_token_seconds_count", engine)] == 1.0
    assert ("vllm:e2e_request_latency_seconds_count", engine) in samples
    assert ("vllm:inter_token_latency_seconds_count", engine) in samples
    config = frozenset(
        {("block_size", "16"), ("enable_prefix_caching", "True"), ("engine", "0"), ("num_gpu_blocks", "512")}
    )
    assert [value for (name, labels), value in samples.items() if name == "vllm:cache_config_info" and config <= labels] \
        == [1.0]
    lora_sets = {labels: value for (name, labels), value in samples.items() if name == "vllm:lora_requests_info"}
    assert (
        frozenset({("max_lora", "1"), ("running_lora_adapters", "sql-lora"), ("waiting_lora_adapters", "")})
        in lora_sets
    )
    async with session.get(f"{fleet.urls[0]}/metrics") as response:
        text = await response.text()
    config_line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    names = [pair.split("=")[0] for pair in config_line[len("vllm:cache_config_info{"):config_line.index("}")].split(",")]
    assert names == sorted(names) and 'block_size="16"' in config_line and 'num_gpu_blocks="512"' in config_line


async def test_repeated_long_prompt_hits_prefix_cache_and_other_prompt_misses(start_fleet, session):
    fleet = await start_fleet()
    url = fleet.urls[0]
    assert await cache_hits_of(session, url, text_of_tokens(200, "a")) == 0
    # Only full blocks hit, and the last prompt token is always recomputed: (200 - 1) // 16 blocks.
    assert await cache_hits_of(session, url, text_of_tokens(200, "a")) == 192
    assert await cache_hits_of(session, url, text_of_tokens(200, "b")) == 0
    assert await cache_hits_of(session, url, text_of_tokens(64, "a") + text_of_tokens(136, "c")) == 64
    counters = await stats(session, url)
    assert counters["prefix_cache_queries"] == 800 and counters["prefix_cache_hits"] == 256
    samples = await metric_samples(session, url)
    assert samples[("vllm:prefix_cache_hits_total", frozenset({("engine", "0"), ("model_name", MODEL)}))] == 256.0


async def test_cache_salt_and_lora_separate_cache_entries(start_fleet, session):
    fleet = await start_fleet(lora_adapters=("sql-lora",))
    url, prompt = fleet.urls[0], text_of_tokens(100)
    await complete(session, url, prompt)
    before = (await stats(session, url))["prefix_cache_hits"]
    await complete(session, url, prompt, cache_salt="tenant-a")
    await complete(session, url, prompt, model="sql-lora")
    assert (await stats(session, url))["prefix_cache_hits"] == before


async def test_reset_zeroes_stats_and_clears_cache(start_fleet, session):
    fleet = await start_fleet()
    url, prompt = fleet.urls[0], text_of_tokens(100)
    await complete(session, url, prompt)
    async with session.post(f"{url}/sim/reset") as response:
        assert (await response.json())["requests"] == 0
    assert await cache_hits_of(session, url, prompt) == 0


async def test_least_recently_used_blocks_are_evicted_first(start_fleet, session):
    fleet = await start_fleet(num_gpu_blocks=16, max_model_len=256)
    url = fleet.urls[0]
    prompt_a, prompt_b = text_of_tokens(96, "a"), text_of_tokens(96, "b")
    await complete(session, url, prompt_a)
    await complete(session, url, prompt_b)
    assert await cache_hits_of(session, url, prompt_a) == 80  # A is now more recent than B
    await complete(session, url, text_of_tokens(128, "c"))  # 8 blocks: only 4 are free, 4 are evicted
    assert await cache_hits_of(session, url, prompt_a) == 80
    assert await cache_hits_of(session, url, prompt_b) < 80
    assert (await stats(session, url))["evictions"] >= 4


async def test_cached_prompt_gets_first_token_sooner(start_fleet, session):
    fleet = await start_fleet(speed=1.0, prefill_seconds_per_token=0.0002, decode_step_seconds=0.002)
    payload = {"model": MODEL, "prompt": text_of_tokens(1500), "max_tokens": 1}

    async def first_token_seconds() -> float:
        started = time.monotonic()
        async with session.post(f"{fleet.urls[0]}/v1/completions", json=payload) as response:
            await response.read()
        return time.monotonic() - started

    cold = await first_token_seconds()
    warm = await first_token_seconds()
    assert cold >= 0.25 and warm < cold / 3  # 1500 uncached tokens x 0.2 ms


async def test_requests_beyond_max_num_seqs_wait(start_fleet, session):
    fleet = await start_fleet(max_num_seqs=2, speed=1.0, decode_step_seconds=0.01)
    url = fleet.urls[0]
    payload = {"model": MODEL, "prompt": "hello", "max_tokens": 30}
    tasks = [asyncio.create_task(session.post(f"{url}/v1/completions", json=payload)) for _ in range(5)]

    async def queue_is_full() -> bool:
        counters = await stats(session, url)
        return counters["running"] == 2 and counters["waiting"] == 3

    await wait_for(queue_is_full)
    samples = await metric_samples(session, url)
    assert samples[("vllm:num_requests_waiting", frozenset({("engine", "0"), ("model_name", MODEL)}))] == 3.0
    for response in await asyncio.gather(*tasks):
        assert (await response.json())["usage"]["completion_tokens"] == 30
    assert (await stats(session, url))["completed"] == 5


async def test_gauges_and_the_step_count_change_once_per_engine_step(start_fleet, session):
    # As vLLM's: a request that arrives during a step shows on /metrics only after the next step's schedule.
    fleet = await start_fleet(speed=1.0, prefill_seconds_per_token=0.002)  # ~1 s to prefill the first prompt
    url = fleet.urls[0]
    waiting = ("vllm:num_requests_waiting", frozenset({("engine", "0"), ("model_name", MODEL)}))
    steps = ("vllm:iteration_tokens_total_count", frozenset({("engine", "0"), ("model_name", MODEL)}))
    first = asyncio.create_task(session.post(f"{url}/v1/completions",
                                             json={"model": MODEL, "prompt": "word " * 400, "max_tokens": 2}))
    await wait_for(lambda: _running(session, url))
    during = await metric_samples(session, url)
    second = asyncio.create_task(session.post(f"{url}/v1/completions",
                                              json={"model": MODEL, "prompt": "hello", "max_tokens": 2}))
    await asyncio.sleep(0.2)  # it has arrived, mid-step
    later = await metric_samples(session, url)
    assert later[waiting] == during[waiting] == 0 and later[steps] == during[steps]
    for response in await asyncio.gather(first, second):
        assert response.status == 200
    assert (await metric_samples(session, url))[steps] > during[steps]


async def _running(session: aiohttp.ClientSession, url: str) -> bool:
    return (await stats(session, url))["running"] == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_client_disconnect_aborts_the_sequence_and_frees_blocks(start_fleet, session, stream):
    fleet = await start_fleet(speed=1.0, decode_step_seconds=0.01)
    url = fleet.urls[0]
    payload = {"model": MODEL, "prompt": text_of_tokens(100), "max_tokens": 1000, "stream": stream}
    request = asyncio.create_task(session.post(f"{url}/v1/completions", json=payload))

    async def running() -> bool:
        return (await stats(session, url))["running"] == 1

    await wait_for(running)
    request.cancel()  # closes the connection, streamed or not
    with contextlib.suppress(asyncio.CancelledError):
        (await request).close()

    async def aborted() -> bool:
        counters = await stats(session, url)
        return counters["aborts"] == 1 and counters["running"] == 0 and counters["kv_cache_usage"] == 0.0

    await wait_for(aborted, timeout=2.0)
    samples = await metric_samples(session, url)
    abort = frozenset({("engine", "0"), ("finished_reason", "abort"), ("model_name", MODEL)})
    assert samples[("vllm:request_success_total", abort)] == 1.0


async def test_stopping_the_fleet_ends_open_streams_with_an_error_event(start_fleet, session):
    fleet = await start_fleet(speed=1.0, decode_step_seconds=0.01)
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True}
    async with session.post(f"{fleet.urls[0]}/v1/completions", json=payload) as response:
        await response.content.readuntil(b"\n\n")
        await asyncio.wait_for(fleet.stop(), timeout=1.5)
        rest = await response.read()
    error_event, done = rest.split(b"\n\n")[-3:-1]
    assert orjson.loads(error_event.removeprefix(b"data: "))["error"]["code"] == 500
    assert done == b"data: [DONE]"


async def test_health_hangs_until_the_model_is_loaded(start_fleet, session):
    fleet = await start_fleet(speed=1.0, startup_seconds=0.3)
    with pytest.raises(TimeoutError):
        async with session.get(f"{fleet.urls[0]}/health", timeout=aiohttp.ClientTimeout(total=0.1)):
            pass
    await asyncio.sleep(0.3)
    async with session.get(f"{fleet.urls[0]}/health") as response:
        assert response.status == 200


async def test_begin_shutdown_refuses_new_requests_while_in_flight_ones_finish(start_fleet, session):
    fleet = await start_fleet(speed=1.0, decode_step_seconds=0.01)
    url = fleet.urls[0]
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 20, "stream": True}
    async with session.post(f"{url}/v1/completions", json=payload) as in_flight:
        await in_flight.content.readuntil(b"\n\n")
        fleet.replicas[0].begin_shutdown()
        async with session.post(f"{url}/v1/completions", json={"prompt": "y"}) as refused:
            assert refused.status == 503
            assert await refused.json() == {"error": "Server is unavailable. Please try again later."}
        async with session.get(f"{url}/health") as health:
            assert health.status == 503
        rest = await in_flight.read()
    assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in rest
    assert await fleet.replicas[0].drain(timeout=1.0)


async def test_three_replicas_serve_300_concurrent_streams(start_fleet, session):
    fleet = await start_fleet(replicas=3, speed=10.0)

    async def stream(index: int) -> int:
        url = fleet.urls[index % 3]
        payload = {"model": MODEL, "prompt": text_of_tokens(50 + index), "max_tokens": 16, "stream": True}
        async with session.post(f"{url}/v1/completions", json=payload) as response:
            events = await read_events(response)
        return sum(1 for event in events if b'"text"' in event)

    started = time.monotonic()
    chunks = await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(300))), timeout=20)
    assert all(count == 16 for count in chunks)
    assert time.monotonic() - started < 15
    completed = [(await stats(session, url))["completed"] for url in fleet.urls]
    assert completed == [100, 100, 100]


def _sequence(seed: str, num_tokens: int = 8, **fields: Any) -> Sequence:
    """A bare engine sequence of `num_tokens` prompt tokens."""
    return Sequence(tokens=TokenSeq.from_text(text_of_tokens(num_tokens, seed)), arrival_time=0.0, **fields)


def test_full_cache_preempts_the_newest_running_sequence():
    core = EngineCore(SimOptions(num_gpu_blocks=4, block_size=16, max_model_len=64))
    first, second = _sequence("a", 32, max_tokens=40), _sequence("b", 32, max_tokens=40)
    core.add(first)
    core.add(second)
    core.schedule()
    assert core.running == [first, second] and core.cache.pinned_blocks == 4
    core.complete_step(now=1.0)  # each now holds 33 tokens: a third block is needed
    core.schedule()
    assert core.running == [first] and core.num_waiting == 1 and core.totals.preemptions == 1
    assert core.cache.pinned_blocks == 3


def test_blocks_shared_by_running_sequences_count_once():
    core = EngineCore(SimOptions())
    first, second = _sequence("a", 64, max_tokens=4), _sequence("a", 64, max_tokens=4)
    core.add(first)
    core.add(second)
    core.schedule()
    # The second reuses 3 blocks (its last token is recomputed) and holds a private copy of the fourth.
    assert core.totals.prefix_cache_hits == 48 and core.cache.pinned_blocks == 5


def test_priority_scheduling_admits_lower_priority_values_first():
    core = EngineCore(SimOptions(max_num_seqs=1, priority_scheduling=True))
    first, background, urgent = (
        _sequence("a", max_tokens=1),
        _sequence("b", max_tokens=1, priority=10),
        _sequence("c", max_tokens=1, priority=-1),
    )
    for seq in (first, background, urgent):
        core.add(seq)
    admitted = []
    for step in range(3):
        core.schedule()
        admitted += core.running
        core.complete_step(now=float(step))
    assert admitted == [urgent, first, background]


def test_batch_holds_at_most_max_loras_adapters():
    core = EngineCore(SimOptions(max_loras=1, lora_adapters=("x", "y")))
    for seq in (
        _sequence("a", max_tokens=5, lora="x"),
        _sequence("b", max_tokens=5, lora="y"),
        _sequence("c", max_tokens=5),
    ):
        core.add(seq)
    core.schedule()
    assert core.running_loras() == ["x"] and len(core.running) == 2
    assert core.waiting_loras() == ["y"]


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks():
    core = EngineCore(SimOptions(max_num_batched_tokens=64, block_size=16))
    seq = _sequence("a", 150, max_tokens=2)
    core.add(seq)
    steps = []
    for step in range(3):
        work = core.schedule()
        steps.append((work.prefill_tokens, seq.num_computed, core.cache.pinned_blocks))
        core.complete_step(now=float(step))
    # 64 + 64 + 22 tokens; blocks are held only for what is computed, and the first token follows the last chunk.
    assert steps == [(64, 64, 4), (64, 128, 8), (22, 150, 10)]
    assert seq.output_ids and seq.first_token_time == 2.0
    decode = core.schedule()
    assert (decode.num_tokens, decode.prefill_tokens, decode.num_seqs) == (1, 0, 1)


def test_running_sequences_take_the_budget_before_waiting_ones():
    core = EngineCore(SimOptions(max_num_batched_tokens=64, block_size=16))
    running = _sequence("a", 40, max_tokens=10)
    core.add(running)
    core.schedule()
    core.complete_step(now=0.0)
    waiting = _sequence("b", 100, max_tokens=1)
    core.add(waiting)
    work = core.schedule()
    # The decode's token comes first; the new prompt gets the 63 tokens left.
    assert (work.num_seqs, work.num_tokens, work.prefill_tokens) == (2, 64, 63)
    assert waiting.num_computed == 63
    outcome = core.complete_step(now=1.0)
    assert outcome.advanced == [running] and len(running.output_ids) == 2


def test_a_waiting_prompt_waits_until_blocks_for_all_of_it_are_free():
    core = EngineCore(SimOptions(max_num_batched_tokens=64, block_size=16, num_gpu_blocks=8, max_model_len=128))
    holder = _sequence("a", 20, max_tokens=50)
    core.add(holder)
    core.schedule()
    core.complete_step(now=0.0)  # the holder keeps 2 blocks, 6 are free
    too_long = _sequence("b", 120, max_tokens=1)
    core.add(too_long)
    core.schedule()
    # Its first chunk (63 tokens beside the holder's decode) would take 4 blocks; the whole prompt needs 8. vLLM
    # admits it only once all 8 are free (--scheduler-reserve-full-isl, its default).
    assert core.running == [holder] and core.num_waiting == 1 and core.cache.pinned_blocks == 2


def test_cli_flags_cover_every_option():
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    options = sim_options_from_args(
        parser.parse_args(
            [
                "--models",
                "m1",
                "m2",
                "--num-gpu-blocks",
                "999",
                "--speed",
                "2.5",
                "--priority-scheduling",
                "--no-enable-prefix-caching",
            ]
        )
    )
    assert options == SimOptions(
        models=("m1", "m2"), num_gpu_blocks=999, speed=2.5, priority_scheduling=True, enable_prefix_caching=False
    )
    assert sim_options_from_args(parser.parse_args([])) == SimOptions()
    with pytest.raises(ValueError, match="max_model_len"):
        SimOptions(num_gpu_blocks=4)


async def test_metrics_page_has_the_shape_of_real_vllms(start_fleet, session):
    """Every vllm: family of a real vLLM 0.32.0 page, with its type and label names, and nothing else."""
    fleet = await start_fleet()
    async with session.get(fleet.urls[0] + "/metrics") as response:
        simulated = vllm_family_shapes(await response.text())
    real = vllm_family_shapes(REAL_PAGE.read_text())
    assert {name: shape for name, shape in simulated.items() if real.get(name) != shape} == {}
    assert sorted(set(real) - set(simulated)) == []
