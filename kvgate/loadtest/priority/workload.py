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
    lead_in: bool = False  # sent before the flood, while interactive traffic alone was flowing


def poisson_arrivals(rate: float, duration: float, batch_fraction: float, seed: int,
                     lead_in_s: float = 0.0) -> list[Arrival]:
    """Arrivals of a Poisson process at `rate` req/s over `duration` seconds, each batch with `batch_fraction`.

    The first `lead_in_s` seconds carry the interactive share alone, so the batch flood arrives on top of
    interactive traffic that is already flowing, as it does on a fleet sized for interactive load.
    """
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


def request_body(model: str, index: int, prompt_words: int, max_tokens: int, stream: bool = True) -> bytes:
    """A chat completion whose prompt differs from the first word, so no request hits another's cache.

    `max_tokens` is the mean output length; each request's own varies around it (output_tokens).
    """
    words = " ".join(_PROMPT_WORDS[(index + i) % len(_PROMPT_WORDS)] for i in range(prompt_words))
    body = {"model": model, "messages": [{"role": "user", "content": f"request {index}: {words}"}],
            "max_tokens": output_tokens(index, max_tokens), "stream": stream}
    return orjson.dumps(body)
