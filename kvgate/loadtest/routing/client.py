"""The routing benchmarks' loads and the client that sends the chat ones: scripted multi-turn chats, closed loop
or Poisson arrivals, bounded in count and time, to the targets in turn (several gateways share the load)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from kvgate.loadtest.kit.stream import RequestSample, stream_chat
from kvgate.loadtest.routing.workload import Conversation, Footprint, WorkloadSpec, build_conversations

# Requests still open this long after the time cap are cut off (and count as errors).
_GRACE_SECONDS_AFTER_CAP = 15.0

OnSample = Callable[[RequestSample], None]


def chat_body(spec: WorkloadSpec, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A streamed chat completion request for the workload's model, asking for its usage (with the prompt tokens
    the engine found cached, where it reports them)."""
    return {"model": spec.model, "messages": messages, "max_tokens": spec.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


class _OpenChat:
    """A conversation in progress: the messages so far and how many turns it has sent."""

    __slots__ = ("conversation", "messages", "turn")

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.messages = [{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt else []
        self.turn = 0

    @property
    def finished(self) -> bool:
        return self.turn >= len(self.conversation.user_turns)


class ConversationDriver:
    """Drives conversations: `spec.concurrency` users back to back, or with `spec.rate` > 0 Poisson arrivals.

    Under Poisson arrivals each arrival sends the next turn of a conversation whose previous answer has come
    back, picked at random, or opens a new one while fewer than `concurrency` are open (or none is ready); an
    arrival that finds every open conversation waiting and none left to open is skipped, so a conversation's
    turns stay in order, as a user's do.
    """

    def __init__(self, spec: WorkloadSpec, base_urls: Sequence[str], on_sample: OnSample | None = None) -> None:
        self._spec = spec
        self._targets = itertools.cycle(base_urls)
        self._on_sample = on_sample
        self._rng = random.Random(f"arrivals-{spec.seed}")
        self.samples: list[RequestSample] = []

    async def run(self, conversations: Sequence[Conversation]) -> list[RequestSample]:
        """Drive every conversation (or as many turns as fit in the workload's duration); return the samples."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            if self._spec.rate > 0:
                await self._poisson(session, deque(conversations), start)
            else:
                queue = iter(conversations)
                await asyncio.gather(*(self._user(session, queue, start) for _ in range(self._spec.concurrency)))
        return self.samples

    async def _user(self, session: aiohttp.ClientSession, queue: Iterator[Conversation], start: float) -> None:
        loop = asyncio.get_running_loop()
        for conversation in queue:
            chat = _OpenChat(conversation)
            while not chat.finished and loop.time() < start + self._spec.duration:
                if not await self._send(session, chat, start):
                    break  # a real user would not continue a conversation that failed

    async def _poisson(self, session: aiohttp.ClientSession, unopened: deque[Conversation], start: float) -> None:
        loop = asyncio.get_running_loop()
        ready: list[_OpenChat] = []
        busy: set[asyncio.Task[None]] = set()
        arrival = start
        while (unopened or ready or busy) and arrival < start + self._spec.duration:
            arrival += self._rng.expovariate(self._spec.rate)
            await asyncio.sleep(max(0.0, arrival - loop.time()))
            if unopened and (len(ready) + len(busy) < self._spec.concurrency or not ready):
                chat = _OpenChat(unopened.popleft())
            elif ready:
                chat = ready.pop(self._rng.randrange(len(ready)))
            else:
                continue
            task = asyncio.create_task(self._send_then_ready(session, chat, ready, start))
            busy.add(task)
            task.add_done_callback(busy.discard)
        if busy:
            await asyncio.gather(*busy)

    async def _send_then_ready(self, session: aiohttp.ClientSession, chat: _OpenChat, ready: list[_OpenChat],
                               start: float) -> None:
        if await self._send(session, chat, start) and not chat.finished:
            ready.append(chat)

    async def _send(self, session: aiohttp.ClientSession, chat: _OpenChat, start: float) -> bool:
        """Send the conversation's next turn and keep the answer in its history; whether it succeeded."""
        chat.messages.append({"role": "user", "content": chat.conversation.user_turns[chat.turn]})
        chat.turn += 1
        cutoff = start + self._spec.duration + _GRACE_SECONDS_AFTER_CAP - asyncio.get_running_loop().time()
        sample, reply = await stream_chat(session, next(self._targets), chat_body(self._spec, chat.messages),
                                          start, cutoff, turn=chat.turn - 1)
        self.samples.append(sample)
        if self._on_sample is not None:
            self._on_sample(sample)
        chat.messages.append({"role": "assistant", "content": reply})
        return sample.error is None


class Load(Protocol):
    """One workload every row of a routing benchmark is measured on."""

    name: str  # in the report
    model: str  # the model its requests ask for
    skewed: bool  # popularity is skewed: the balance targets apply
    single_target: bool  # its load generator takes one base URL: several gateways then need a front

    def describe(self) -> str:
        """One sentence on what it sends."""

    def footprint(self, block_size: int, chars_per_token: float) -> Footprint:
        """How much KV cache its prefixes take."""

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        """Send the load to `targets`; the samples of every request."""


@dataclass(frozen=True, slots=True)
class ChatLoad:
    """Multi-turn chats of tenants sharing system prompts, sent by the benchmark's own client."""

    name: str
    spec: WorkloadSpec
    single_target = False

    @property
    def model(self) -> str:
        """The workload's model."""
        return self.spec.model

    @property
    def skewed(self) -> bool:
        """Zipf popularity is skewed."""
        return self.spec.skew == "zipf"

    def describe(self) -> str:
        """Tenants, prompts, conversations, and how they arrive."""
        spec = self.spec
        popularity = f"Zipf-skewed popularity (s={spec.zipf_s})" if self.skewed else "uniform popularity"
        arrivals = (f"Poisson arrivals at {spec.rate:g} req/s, {spec.concurrency} conversations open at once"
                    if spec.rate else f"{spec.concurrency} concurrent users")
        prompts = (f"each with a {spec.system_prompt_chars}-character system prompt" if spec.system_prompt_chars
                   else "no system prompts")
        return (f"{spec.tenants} tenants, {popularity}, {prompts}; {spec.conversations} conversations of {spec.turns} streamed turns (~{spec.user_chars} "
                f"characters each, max_tokens {spec.max_tokens}), {arrivals}, seed {spec.seed}, capped at "
                f"{spec.duration:.0f} s per row.")

    def footprint(self, block_size: int, chars_per_token: float) -> Footprint:
        """Every tenant's system prompt and every open conversation."""
        return Footprint.of_chats(self.spec, block_size, chars_per_token)

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        """The conversations, through `targets` in turn."""
        return await ConversationDriver(self.spec, targets, on_sample).run(build_conversations(self.spec))
