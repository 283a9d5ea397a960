"""The benchmarks' streaming client: one streamed (SSE) chat completion, its TTFT, chunks and errors; `ChatStream`
folds the lines of any SSE body (the locustfile reads its own with it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

CHAT_PATH = "/v1/chat/completions"
_ERROR_TEXT_CHARS = 200


@dataclass(frozen=True, slots=True)
class RequestSample:
    """What one streamed request did; times in seconds, `start` relative to the run's start."""

    start: float
    ttft: float | None  # to the first non-empty content delta
    e2e: float
    output_chunks: int
    error: str | None
    prompt_tokens: int | None = None  # from the answer's usage, where it reports one
    cached_tokens: int | None = None  # prompt tokens the engine found cached (usage.prompt_tokens_details)
    turn: int | None = None  # a chat's turn (0: its first), where the load is conversations


class ChatStream:
    """Folds the lines of a streamed chat completion: content deltas with their arrival times, an error, the end."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.text: list[str] = []
        self.delta_times: list[float] = []  # clock() at each non-empty content delta
        self.error: str | None = None
        self.done = False
        self.usage: dict[str, Any] = {}  # the usage chunk's (stream_options.include_usage)

    def feed(self, line: bytes) -> None:
        """Take one line of the body; anything but a `data:` line is ignored."""
        if not line.startswith(b"data: "):
            return
        payload = line[6:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        event = orjson.loads(payload)
        if "error" in event:
            self.error = f"stream error: {str(event['error'])[:_ERROR_TEXT_CHARS]}"
            return
        self.usage = event.get("usage") or self.usage
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.delta_times.append(self._clock())
                self.text.append(content)

    def finish(self) -> None:
        """Mark a stream that ended without `[DONE]` or an error event as failed."""
        if self.error is None and not self.done:
            self.error = "stream ended without [DONE]"


class ChatReply(ChatStream):
    """One chat completion's answer: when it was sent and ended, its status (None: no response), `Retry-After`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.sent = self.ended = clock()
        self.status: int | None = None
        self.retry_after: str | None = None
        self.raised = False  # the connection or the answer broke (an exception, not an answer)

    @property
    def ttft(self) -> float | None:
        """Sending to the first non-empty content delta."""
        return self.delta_times[0] - self.sent if self.delta_times else None


async def post_chat(session: aiohttp.ClientSession, base_url: str, body: bytes,
                    headers: Mapping[str, str] | None = None, timeout: float | None = None) -> ChatReply:
    """Send one chat completion (given up after `timeout` seconds, if given) and read its answer, streamed or whole."""
    loop = asyncio.get_running_loop()
    reply = ChatReply(loop.time)
    limit = {} if timeout is None else {"timeout": aiohttp.ClientTimeout(total=max(timeout, 0.001))}
    try:
        async with session.post(base_url + CHAT_PATH, data=body,
                                headers={"Content-Type": "application/json", **(headers or {})}, **limit) as response:
            reply.status, reply.retry_after = response.status, response.headers.get("Retry-After")
            if response.status != 200:
                reply.error = f"HTTP {response.status}: {(await response.text())[:_ERROR_TEXT_CHARS]}"
            elif response.content_type != "text/event-stream":
                answer = orjson.loads(await response.read())
                if not answer.get("choices"):
                    reply.error = f"answer without choices: {str(answer)[:_ERROR_TEXT_CHARS]}"
            else:
                async for line in response.content:
                    reply.feed(line)
                reply.finish()
    except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
        reply.error, reply.raised = f"{type(exc).__name__}: {str(exc)[:_ERROR_TEXT_CHARS]}", True
    reply.ended = loop.time()
    return reply


async def stream_chat(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], run_start: float, timeout: float,
    turn: int | None = None,
) -> tuple[RequestSample, str]:
    """Send one streamed chat completion (a chat's `turn`, where the load is conversations), given up after `timeout`
    seconds; the sample and the reply text."""
    reply = await post_chat(session, base_url, orjson.dumps(body), timeout=timeout)
    details = reply.usage.get("prompt_tokens_details") or {}
    sample = RequestSample(reply.sent - run_start, reply.ttft, reply.ended - reply.sent, len(reply.delta_times),
                           reply.error, reply.usage.get("prompt_tokens"), details.get("cached_tokens"), turn)
    return sample, "".join(reply.text)
