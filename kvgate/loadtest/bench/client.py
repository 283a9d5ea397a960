"""The benchmark's load generator: streamed multi-turn chats over aiohttp, bounded in count and time."""

from __future__ import annotations

import asyncio
import itertools
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


class ConversationDriver:
    """Runs scripted conversations with a fixed number of concurrent users until they end or time runs out.

    Requests go to `base_urls` in turn (client-side round robin), so several gateways share the load.
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
        self.samples: list[RequestSample] = []

    async def run(self, conversations: Sequence[Conversation]) -> list[RequestSample]:
        """Drive every conversation (or as many as fit in the workload's duration); return the samples."""
        loop = asyncio.get_running_loop()
        run_start = loop.time()
        deadline = run_start + self._spec.duration
        queue = iter(conversations)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            users = [self._user(session, queue, run_start, deadline) for _ in range(self._spec.concurrency)]
            await asyncio.gather(*users)
        return self.samples

    async def _user(
        self, session: aiohttp.ClientSession, queue: Iterator[Conversation], run_start: float, deadline: float
    ) -> None:
        loop = asyncio.get_running_loop()
        for conversation in queue:
            messages = [{"role": "system", "content": conversation.system_prompt}]
            for user_turn in conversation.user_turns:
                if loop.time() >= deadline:
                    return
                messages.append({"role": "user", "content": user_turn})
                cutoff = deadline + _GRACE_SECONDS_AFTER_CAP - loop.time()
                sample, reply = await stream_chat(session, next(self._targets), chat_body(self._spec, messages),
                                                  run_start, cutoff)
                self.samples.append(sample)
                if self._on_sample is not None:
                    self._on_sample(sample)
                if sample.error is not None:
                    break  # a real user would not continue a conversation that failed
                messages.append({"role": "assistant", "content": reply})
