"""Chat request bodies of an exact size, distinct after a shared system prompt like real traffic."""

from __future__ import annotations

import orjson

from kvgate.loadtest.kit.vllm_metrics_page import DEFAULT_MODEL

_SYSTEM = "You are a careful assistant. Answer briefly and cite the documents you were given."
_WORDS = "the quick brown fox jumps over the lazy dog "


def chat_bodies(size_bytes: int, count: int, stream: bool) -> list[bytes]:
    """`count` chat bodies of `size_bytes` bytes each; each user message starts with its own number."""
    bodies = []
    for n in range(count):
        body = {"model": DEFAULT_MODEL, "stream": stream, "max_tokens": 16,
                "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": ""}]}
        room = size_bytes - len(orjson.dumps(body))
        text = f"request {n}: " + _WORDS * (room // len(_WORDS) + 1)
        body["messages"][1]["content"] = text[:max(room, 0)]
        bodies.append(orjson.dumps(body))
    return bodies
