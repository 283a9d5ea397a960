"""Steady streaming load: a fixed number of chat clients sending back-to-back requests until told to stop."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp

from kvgate.loadtest.kit.stream import RequestSample, stream_chat
from kvgate.loadtest.routing.workload import system_prompt

_REQUEST_TIMEOUT_SECONDS = 30.0
_SYSTEM_PROMPT_CHARS = 800


class SteadyLoad:
    """`concurrency` clients streaming chat completions through `url`, bounded in count and time.

    Clients cycle over `tenants` system prompts so a cache-aware gateway spreads them over the fleet.
    """

    def __init__(self, url: str, model: str, concurrency: int, max_requests: int, max_seconds: float,
                 max_tokens: int, tenants: int = 16) -> None:
        self.samples: list[RequestSample] = []
        self.run_start = 0.0  # event loop time the run began; samples' `start` is relative to it
        self._url = url
        self._model = model
        self._concurrency = concurrency
        self._max_requests = max_requests
        self._max_seconds = max_seconds
        self._max_tokens = max_tokens
        self._prompts = [system_prompt(tenant, _SYSTEM_PROMPT_CHARS) for tenant in range(tenants)]
        self._numbers = itertools.count()
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Let every client finish its current request and send no more."""
        self._stopping.set()

    async def run(self) -> list[RequestSample]:
        """Run the clients until stopped, `max_requests` were sent, or `max_seconds` passed."""
        loop = asyncio.get_running_loop()
        self.run_start = loop.time()
        deadline = self.run_start + self._max_seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(self._client(session, deadline) for _ in range(self._concurrency)))
        return self.samples

    async def _client(self, session: aiohttp.ClientSession, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set() and loop.time() < deadline:
            number = next(self._numbers)
            if number >= self._max_requests:
                return
            body = {
                "model": self._model,
                "messages": [{"role": "system", "content": self._prompts[number % len(self._prompts)]},
                             {"role": "user", "content": f"Question {number}: where is my order?"}],
                "max_tokens": self._max_tokens,
                "stream": True,
            }
            sample, _ = await stream_chat(session, self._url, body, self.run_start, _REQUEST_TIMEOUT_SECONDS)
            self.samples.append(sample)
