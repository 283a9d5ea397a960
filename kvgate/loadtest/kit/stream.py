"""The benchmarks' streaming client: one streamed (SSE) chat completion, its TTFT, chunks and errors; `ChatStream`
folds the lines of any SSE body (the locustfile reads its own with it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
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


class ChatStream:
    """Folds the lines of a streamed chat completion: content deltas with their arrival times, an error, the end."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.text: list[str] = []
        self.delta_times: list[float] = []  # clock() at each non-empty content delta
        self.error: str | None = None
        self.done = False

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
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.delta_times.append(self._clock())
                self.text.append(content)

    def finish(self) -> None:
        """Mark a stream that ended without `[DONE]` or an error event as failed."""
        if self.error is None and not self.done:
            self.error = "stream ended without [DONE]"


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
