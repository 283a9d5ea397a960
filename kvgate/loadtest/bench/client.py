"""The benchmark's load generator: streamed multi-turn chats over aiohttp, bounded in count and time."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvgate.loadtest.bench.sse import ChatStream
from kvgate.loadtest.bench.workload import Conversation, WorkloadSpec

CHAT_PATH = "/v1/chat/completions"
# Requests still open this long after the time cap are cut off (and count as errors).
_GRACE_SECONDS_AFTER_CAP = 15.0
_ERROR_TEXT_CHARS = 200


@dataclass(frozen=True, slots=True)
class RequestSample:
    """What one streamed request did; times in seconds, `start` relative to the run's start."""

    start: float
    ttft: float | None  # to the first non-empty content delta
    e2e: float
    output_chunks: int
    error: str | None


async def stream_chat(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], run_start: float, timeout: float
) -> tuple[RequestSample, str]:
    """Send one streamed chat completion, given up after `timeout` seconds; the sample and the reply text."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    reply = ChatStream(loop.time)
    try:
        async with session.post(base_url + CHAT_PATH, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=max(timeout, 0.001))) as response:
            if response.status != 200:
                text = await response.text()
                reply.error = f"HTTP {response.status}: {text[:_ERROR_TEXT_CHARS]}"
            else:
                async for line in response.content:
                    reply.feed(line)
                reply.finish()
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        reply.error = f"{type(exc).__name__}: {str(exc)[:_ERROR_TEXT_CHARS]}"
    sample = RequestSample(
        start=start - run_start,
        ttft=reply.delta_times[0] - start if reply.delta_times else None,
        e2e=loop.time() - start,
        output_chunks=len(reply.delta_times),
        error=reply.error,
    )
    return sample, "".join(reply.text)


def chat_body(spec: WorkloadSpec, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A streamed chat completion request for the workload's model."""
    return {"model": spec.model, "messages": messages, "max_tokens": spec.max_tokens, "stream": True}


class _OpenChat:
    """A conversation in progress: the messages so far and how many turns it has sent."""

    __slots__ = ("conversation", "messages", "turn")

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.messages = [{"role": "system", "content": conversation.system_prompt}]
        self.turn = 0

    @property
    def finished(self) -> bool:
        return self.turn >= len(self.conversation.user_turns)


class PoissonChatDriver:
    """Sends chat turns as a Poisson process of `rate` requests per second, bounded in count and time.

    Each arrival sends the next turn of a conversation whose previous answer has come back, picked at
    random among them, or opens a new conversation while fewer than `concurrency` are open (or none is
    ready). An arrival that finds every open conversation waiting for its answer and none left to open
    is skipped, so a conversation's turns stay in order, as a user's do. Requests go to `base_urls` in
    turn (client-side round robin), so several gateways share the load.
    """

    def __init__(
        self,
        spec: WorkloadSpec,
        base_urls: Sequence[str],
        on_sample: Callable[[RequestSample], None] | None = None,
    ) -> None:
        self._spec = spec
        self._targets = itertools.cycle(base_urls)
        self._on_sample = on_sample
        self._rng = random.Random(f"arrivals-{spec.seed}")
        self.samples: list[RequestSample] = []

    async def run(self, conversations: Sequence[Conversation]) -> list[RequestSample]:
        """Drive the conversations (or as many turns as fit in the workload's duration); return the samples."""
        loop = asyncio.get_running_loop()
        run_start = loop.time()
        deadline = run_start + self._spec.duration
        unopened = deque(conversations)
        ready: list[_OpenChat] = []
        busy: set[asyncio.Task[None]] = set()
        arrival = run_start
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while (unopened or ready or busy) and arrival < deadline:
                arrival += self._rng.expovariate(self._spec.rate)
                await asyncio.sleep(max(0.0, arrival - loop.time()))
                chat = self._next_chat(unopened, ready, len(ready) + len(busy))
                if chat is None:
                    continue
                task = asyncio.create_task(self._send(session, chat, ready, run_start, deadline))
                busy.add(task)
                task.add_done_callback(busy.discard)
            if busy:
                await asyncio.gather(*busy)
        return self.samples

    def _next_chat(self, unopened: deque[Conversation], ready: list[_OpenChat], open_now: int) -> _OpenChat | None:
        if unopened and (open_now < self._spec.concurrency or not ready):
            return _OpenChat(unopened.popleft())
        if ready:
            return ready.pop(self._rng.randrange(len(ready)))
        return None

    async def _send(self, session: aiohttp.ClientSession, chat: _OpenChat, ready: list[_OpenChat],
                    run_start: float, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        chat.messages.append({"role": "user", "content": chat.conversation.user_turns[chat.turn]})
        chat.turn += 1
        cutoff = deadline + _GRACE_SECONDS_AFTER_CAP - loop.time()
        sample, reply = await stream_chat(session, next(self._targets), chat_body(self._spec, chat.messages),
                                          run_start, cutoff)
        self.samples.append(sample)
        if self._on_sample is not None:
            self._on_sample(sample)
        if sample.error is None and not chat.finished:  # a real user would not continue a failed conversation
            chat.messages.append({"role": "assistant", "content": reply})
            ready.append(chat)
