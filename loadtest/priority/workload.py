"""The offered load: Poisson arrivals of interactive and batch requests, and the body each one sends."""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson

INTERACTIVE = "interactive"
BATCH = "batch"
_PROMPT_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the schedule: when it is sent (seconds after the run starts) and its class."""

    index: int
    at: float
    priority: str


def poisson_arrivals(rate: float, duration: float, batch_fraction: float, seed: int) -> list[Arrival]:
    """Arrivals of a Poisson process at `rate` req/s over `duration` seconds, each batch with `batch_fraction`."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    at = rng.expovariate(rate)
    while at < duration:
        priority = BATCH if rng.random() < batch_fraction else INTERACTIVE
        arrivals.append(Arrival(len(arrivals), at, priority))
        at += rng.expovariate(rate)
    return arrivals


def request_body(model: str, index: int, prompt_words: int, max_tokens: int) -> bytes:
    """A streamed chat completion whose prompt differs from the first word, so no request hits another's cache."""
    words = " ".join(_PROMPT_WORDS[(index + i) % len(_PROMPT_WORDS)] for i in range(prompt_words))
    body = {"model": model, "messages": [{"role": "user", "content": f"request {index}: {words}"}],
            "max_tokens": max_tokens, "stream": True}
    return orjson.dumps(body)
