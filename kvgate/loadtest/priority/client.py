"""The priority benchmark's load: Poisson arrivals of interactive and batch requests, sent whatever the answers do."""

from __future__ import annotations

import asyncio
import enum
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from kvgate.loadtest.kit.stream import post_chat

INTERACTIVE = "interactive"
BATCH = "batch"
_PROMPT_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
# No per-request timeout: the run's drain bounds every request, and one still open when it ends counts as lost.
_SESSION_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the schedule: when it is sent (seconds after the run starts) and its class."""

    index: int
    at: float
    priority: str
    lead_in: bool = False  # sent before the flood, while interactive traffic alone was flowing


BodyFor = Callable[[Arrival], bytes]  # the request's body


def poisson_arrivals(rate: float, duration: float, batch_fraction: float, seed: int,
                     lead_in_s: float = 0.0) -> list[Arrival]:
    """Poisson arrivals at `rate` req/s for `duration` s, each batch with `batch_fraction`, after `lead_in_s` s of
    the interactive share alone (the flood lands on interactive traffic already flowing)."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    at = rng.expovariate(rate)
    while at < lead_in_s + duration:
        priority = BATCH if rng.random() < batch_fraction else INTERACTIVE
        if at >= lead_in_s or priority == INTERACTIVE:
            arrivals.append(Arrival(len(arrivals), at, priority, lead_in=at < lead_in_s))
        at += rng.expovariate(rate)
    return arrivals


def output_tokens(index: int, mean: int) -> int:
    """Request `index`'s output length: uniform over mean/2 .. 3 mean/2, as real answers vary (fixed per index)."""
    return random.Random(index).randint(mean // 2, output_tokens_max(mean))


def output_tokens_max(mean: int) -> int:
    """The longest output `output_tokens` gives for `mean`."""
    return mean + mean // 2


def request_body(model: str, index: int, prompt_words: int, max_tokens: int, stream: bool = True,
                 system: str = "") -> bytes:
    """A chat completion of `output_tokens(index, max_tokens)` tokens whose user message is unlike others' from its
    first word, after the `system` prompt it shares with other requests (none when empty)."""
    words = " ".join(_PROMPT_WORDS[(index + i) % len(_PROMPT_WORDS)] for i in range(prompt_words))
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"request {index}: {words}"})
    return orjson.dumps({"model": model, "messages": messages, "max_tokens": output_tokens(index, max_tokens),
                         "stream": stream})


class Outcome(enum.StrEnum):
    """How a request ended."""

    OK = "ok"  # 200 and a complete answer
    SHED = "shed"  # 429 from the admission queue
    ERROR = "error"  # any other status, or a stream that broke
    LOST = "lost"  # no response at all: the connection failed or nothing came back before the drain ended


@dataclass(frozen=True, slots=True)
class Sample:
    """What one request did; times in seconds."""

    priority: str
    outcome: Outcome
    lag: float  # how late the generator sent it against its schedule
    ttft: float | None = None  # send to the first non-empty content delta (streamed answers only)
    e2e: float | None = None  # send to the end of the response
    finished_at: float | None = None  # end of the response, after the run's start
    retry_after: str | None = None
    detail: str = ""
    lead_in: bool = False  # sent before the flood (Arrival.lead_in)


async def send(session: aiohttp.ClientSession, url: str, arrival: Arrival, body: bytes, run_start: float) -> Sample:
    """Send one request with its class in `x-priority` and classify the answer, streamed or whole."""
    reply = await post_chat(session, url, body, {"x-priority": arrival.priority})
    lag = reply.sent - run_start - arrival.at
    if reply.raised:  # a failure before any status is a request left without an answer; after it, a broken answer
        return Sample(arrival.priority, Outcome.LOST if reply.status is None else Outcome.ERROR, lag,
                      detail=reply.error or "", lead_in=arrival.lead_in)
    outcome = Outcome.OK if reply.error is None else Outcome.SHED if reply.status == 429 else Outcome.ERROR
    return Sample(arrival.priority, outcome, lag, reply.ttft, reply.ended - reply.sent, reply.ended - run_start,
                  reply.retry_after, reply.error or "", arrival.lead_in)


async def run_open_loop(url: str, arrivals: Sequence[Arrival], body_for: BodyFor, drain_cap: float,
                        stall_s: float) -> list[Sample]:
    """Send every arrival on schedule, then wait for the ones still open while answers keep ending (see `_drain`);
    those still open then (unanswered or mid-stream) are cancelled and count as lost. The samples keep the
    arrivals' order."""
    if not arrivals:
        return []
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=_SESSION_TIMEOUT) as session:
        run_start = loop.time()
        tasks: list[asyncio.Task[Sample]] = []
        for arrival in arrivals:
            await asyncio.sleep(max(0.0, run_start + arrival.at - loop.time()))
            tasks.append(asyncio.create_task(send(session, url, arrival, body_for(arrival), run_start)))
        pending = await _drain(tasks, run_start + arrivals[-1].at + drain_cap, stall_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    unanswered = f"no response when the drain ended (nothing else ended for {stall_s:.0f} s, or {drain_cap:.0f} s " \
                 "passed after the last send)"
    return [Sample(arrival.priority, Outcome.LOST, 0.0, detail=unanswered, lead_in=arrival.lead_in)
            if task in pending else task.result() for arrival, task in zip(arrivals, tasks, strict=True)]


async def _drain(tasks: Sequence[asyncio.Task[Sample]], deadline: float, stall_s: float) -> set[asyncio.Task[Sample]]:
    """Wait for `tasks` while the fleet makes progress: until all are done, until `stall_s` seconds pass with none
    of them ending (a hang, not a backlog), or until the loop time `deadline`; the tasks still open then."""
    loop = asyncio.get_running_loop()
    pending = {task for task in tasks if not task.done()}
    while pending and loop.time() < deadline:
        done, pending = await asyncio.wait(pending, timeout=min(stall_s, deadline - loop.time()),
                                           return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
    return pending


async def measure_throughput(urls: Sequence[str], concurrency: int, warmup: float, duration: float,
                             body_for: BodyFor) -> float:
    """Completed requests per second with `concurrency` requests always open (closed loop) across `urls`."""
    loop = asyncio.get_running_loop()
    targets, indexes = itertools.cycle(urls), itertools.count()
    completions: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=_SESSION_TIMEOUT) as session:
        start = loop.time()
        deadline = start + warmup + duration

        async def user() -> None:
            while loop.time() < deadline:
                arrival = Arrival(next(indexes), 0.0, INTERACTIVE)
                sample = await send(session, next(targets), arrival, body_for(arrival), start)
                if sample.outcome is not Outcome.OK:
                    raise RuntimeError(f"capacity probe request failed: {sample.detail}")
                completions.append(loop.time())

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return len([t for t in completions if start + warmup <= t < deadline]) / duration
