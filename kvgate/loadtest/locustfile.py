"""Locust users that model LLM traffic against any OpenAI-compatible URL (kvgate, vLLM, another router).

    locust -f kvgate/loadtest/locustfile.py --headless -u 50 -r 5 -t 2m --host http://127.0.0.1:8080
    locust -f kvgate/loadtest/locustfile.py --host http://127.0.0.1:8080      # web UI on :8089

InteractiveChatUser: picks a tenant, keeps a multi-turn streamed chat under that tenant's long system
prompt (the reply and a new user turn are appended each turn), thinks between turns, and starts a new
conversation after the last turn. BatchUser: long one-shot prompts sent with `x-priority: batch`.

Environment knobs (locust's own options set users, spawn rate, duration, host, CSV output):
    KVGATE_LT_TENANTS=8                  tenants, each with its own deterministic system prompt
    KVGATE_LT_SYSTEM_PROMPT_CHARS=6000   characters of each tenant's system prompt
    KVGATE_LT_SKEW=uniform               tenant popularity: uniform, or zipf (s=1.1)
    KVGATE_LT_TURNS=6                    turns per conversation
    KVGATE_LT_USER_CHARS=300             mean characters of a user turn
    KVGATE_LT_MAX_TOKENS=128             max_tokens of chat requests
    KVGATE_LT_THINK_TIME=1-3             seconds between turns: MIN-MAX or one number
    KVGATE_LT_BATCH_SHARE=0.1            share of users that are BatchUser (sets the class weights)
    KVGATE_LT_BATCH_PROMPT_CHARS=16000   characters of a batch prompt
    KVGATE_LT_BATCH_MAX_TOKENS=256       max_tokens of batch requests
    KVGATE_LT_BATCH_STREAM=1             1: stream batch replies, 0: wait for the whole JSON body
    KVGATE_LT_MODEL=                     the model to ask for; unset: the first one the host's /v1/models lists

Besides the POST rows (time to response headers, failures), each streamed request records custom
rows, by request type and name ("chat" or "batch"): TTFT (sending to the first non-empty content
delta), ITL (every gap between content deltas) and E2E (sending to the end of the stream), in ms.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Iterator
from typing import Any

from locust import HttpUser, between, task
from locust.exception import StopUser

from kvgate.loadtest.kit.stream import CHAT_PATH, ChatStream
from kvgate.loadtest.routing.workload import system_prompt, tenant_weights, user_message

_ZIPF_S = 1.1


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _think_time(text: str) -> tuple[float, float]:
    """`MIN-MAX` or one number of seconds."""
    low, _, high = text.partition("-")
    return float(low), float(high or low)


TENANTS = _env_int("KVGATE_LT_TENANTS", 8)
SYSTEM_PROMPT_CHARS = _env_int("KVGATE_LT_SYSTEM_PROMPT_CHARS", 6000)
SKEW = os.environ.get("KVGATE_LT_SKEW", "uniform")
TURNS = _env_int("KVGATE_LT_TURNS", 6)
USER_CHARS = _env_int("KVGATE_LT_USER_CHARS", 300)
MAX_TOKENS = _env_int("KVGATE_LT_MAX_TOKENS", 128)
THINK_TIME = _think_time(os.environ.get("KVGATE_LT_THINK_TIME", "1-3"))
BATCH_SHARE = float(os.environ.get("KVGATE_LT_BATCH_SHARE", "0.1"))
BATCH_PROMPT_CHARS = _env_int("KVGATE_LT_BATCH_PROMPT_CHARS", 16000)
BATCH_MAX_TOKENS = _env_int("KVGATE_LT_BATCH_MAX_TOKENS", 256)
BATCH_STREAM = os.environ.get("KVGATE_LT_BATCH_STREAM", "1") != "0"
_MODEL = os.environ.get("KVGATE_LT_MODEL") or None  # None: asked of the host once per process

if not 0.0 <= BATCH_SHARE <= 1.0:
    raise ValueError(f"KVGATE_LT_BATCH_SHARE must be within 0..1, got {BATCH_SHARE}")
_TENANT_WEIGHTS = tenant_weights(TENANTS, SKEW, _ZIPF_S)
_SYSTEM_PROMPTS = [system_prompt(tenant, SYSTEM_PROMPT_CHARS) for tenant in range(TENANTS)]
# Conversation numbers seed the user turns' text; a per-process offset keeps locust workers apart.
_CONVERSATIONS = itertools.count(random.SystemRandom().getrandbits(40))


def _sse_lines(response: Any) -> Iterator[bytes]:
    """The lines of a streamed body as they arrive."""
    buffer = b""
    # chunk_size=None hands over data as it arrives; a fixed size would wait to fill it and skew TTFT.
    for chunk in response.iter_content(chunk_size=None):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from lines
    if buffer:
        yield buffer


class _LlmUser(HttpUser):
    """Sends chat completions and records TTFT, inter-token gaps and end-to-end time as custom rows."""

    abstract = True
    label = "chat"

    @property
    def model(self) -> str:
        """KVGATE_LT_MODEL, or the first model the host serves (read once per process from /v1/models)."""
        global _MODEL
        if _MODEL is None:
            with self.client.get("/v1/models", name="/v1/models", catch_response=True) as response:
                models = response.json().get("data") if response.status_code == 200 else None
                if not models:
                    response.failure(f"no model to ask for: /v1/models answered HTTP {response.status_code}")
                    raise StopUser()
                _MODEL = str(models[0]["id"])
        return _MODEL

    def _record(self, request_type: str, milliseconds: float, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=request_type, name=self.label, response_time=milliseconds, response_length=length,
            exception=None, context={},
        )  # fmt: skip

    def _record_stream(self, reply: ChatStream, sent_at: float) -> None:
        if not reply.delta_times:
            return
        self._record("TTFT", (reply.delta_times[0] - sent_at) * 1000)
        for before, after in itertools.pairwise(reply.delta_times):
            self._record("ITL", (after - before) * 1000)
        self._record("E2E", (time.perf_counter() - sent_at) * 1000, len(reply.delta_times))

    def chat(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> str | None:
        """Send one chat completion (streamed if the body says so); the reply text, or None on failure."""
        sent_at = time.perf_counter()
        stream = bool(body.get("stream"))
        with self.client.post(
            CHAT_PATH, json=body, headers=headers, name=self.label, stream=stream, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
                return None
            if not stream:
                choices = response.json().get("choices") or [{}]
                self._record("E2E", (time.perf_counter() - sent_at) * 1000)
                response.success()
                return (choices[0].get("message") or {}).get("content") or ""
            reply = ChatStream(time.perf_counter)
            try:
                for line in _sse_lines(response):
                    reply.feed(line)
                    if reply.done or reply.error:
                        break
                reply.finish()
            except (OSError, ValueError) as exc:
                reply.error = f"{type(exc).__name__}: {exc}"
            if reply.error is not None:
                response.failure(reply.error)
                return None
            response.success()
        self._record_stream(reply, sent_at)
        return "".join(reply.text)


class InteractiveChatUser(_LlmUser):
    """A person chatting: multi-turn streamed conversations under a tenant's shared system prompt."""

    weight = round((1.0 - BATCH_SHARE) * 100)
    wait_time = between(*THINK_TIME)
    label = "chat"

    def on_start(self) -> None:
        """Open the first conversation."""
        self._new_conversation()

    def _new_conversation(self) -> None:
        tenant = random.choices(range(TENANTS), weights=_TENANT_WEIGHTS)[0]
        self.conversation = next(_CONVERSATIONS)
        self.turn = 0
        self.messages = [{"role": "system", "content": _SYSTEM_PROMPTS[tenant]}]

    @task
    def next_turn(self) -> None:
        """Ask the next question of the conversation; start a new one after the last turn or a failure."""
        self.messages.append({"role": "user", "content": user_message(self.conversation, self.turn, USER_CHARS)})
        body = {"model": self.model, "messages": self.messages, "max_tokens": MAX_TOKENS, "stream": True}
        reply = self.chat(body)
        self.turn += 1
        if reply is None or self.turn >= TURNS:
            self._new_conversation()
        else:
            self.messages.append({"role": "assistant", "content": reply})


class BatchUser(_LlmUser):
    """An offline job: long one-shot prompts, each marked `x-priority: batch`."""

    weight = round(BATCH_SHARE * 100)
    wait_time = between(0.5, 1.5)  # a job runner submits back to back, without a person's pauses
    label = "batch"

    @task
    def summarize(self) -> None:
        """Submit one long document to summarize."""
        document = user_message(next(_CONVERSATIONS), 0, BATCH_PROMPT_CHARS)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Summarize this document.\n\n" + document}],
            "max_tokens": BATCH_MAX_TOKENS,
            "stream": BATCH_STREAM,
        }
        self.chat(body, headers={"x-priority": "batch"})
