"""A stand-in tokenizer: four characters per token, a Llama-3-style chat template, deterministic output words.

Tokens live in a flat byte buffer of fixed width per token so that hashing a 16-token block is one
xxhash call over a slice, which keeps 200 KB prompts cheap.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
import xxhash

CHARS_PER_TOKEN = 4
_TEXT_TOKEN_WIDTH = CHARS_PER_TOKEN * 4  # UTF-32 bytes of one four-character token
_ID_TOKEN_WIDTH = 4  # token ids given by the client, as uint32

_WORDS = (
    "the", "model", "cache", "token", "block", "prefix", "batch", "route", "gateway", "replica",
    "stream", "latency", "queue", "decode", "prefill", "kernel", "memory", "tensor", "layer", "attention",
    "request", "answer", "vector", "server", "engine", "paged", "window", "signal", "policy", "score",
    "fleet", "shard",
)  # fmt: skip


class TokenSeq:
    """A growable token sequence stored as fixed-width little-endian records."""

    __slots__ = ("_data", "_width")

    def __init__(self, data: bytes, width: int) -> None:
        self._data = bytearray(data)
        self._width = width

    @classmethod
    def from_text(cls, text: str) -> TokenSeq:
        """Tokenize text at four characters per token (the last token may be shorter)."""
        raw = text.encode("utf-32-le")
        padding = -len(raw) % _TEXT_TOKEN_WIDTH
        return cls(raw + bytes(padding), _TEXT_TOKEN_WIDTH)

    @classmethod
    def from_ids(cls, token_ids: Iterable[int]) -> TokenSeq:
        """Wrap token ids the client passed directly."""
        return cls(b"".join(token_id.to_bytes(_ID_TOKEN_WIDTH, "little") for token_id in token_ids), _ID_TOKEN_WIDTH)

    def __len__(self) -> int:
        return len(self._data) // self._width

    def append(self, token_id: int) -> None:
        """Append one generated token."""
        self._data += token_id.to_bytes(self._width, "little")

    def span(self, start: int, stop: int) -> bytes:
        """The raw bytes of tokens [start, stop)."""
        return bytes(self._data[start * self._width : stop * self._width])

    def ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Token ids [start, stop) of a sequence built from ids (a real tokenizer's output)."""
        if self._width != _ID_TOKEN_WIDTH:
            raise ValueError("text tokens have no ids; give the simulator a tokenizer")
        return tuple(array("I", self.span(start, stop)))  # little-endian records, read on little-endian hosts

    def digest(self) -> int:
        """A 64-bit hash of the whole sequence."""
        return xxhash.xxh3_64_intdigest(self._data)


def output_token(seed: int, position: int) -> int:
    """The id of the generated token at `position` of a sequence whose prompt hashed to `seed`."""
    return (seed + 7 * position) % len(_WORDS)


def token_text(token_id: int) -> str:
    """Detokenize one generated token."""
    return " " + _WORDS[token_id % len(_WORDS)]


def _content_text(content: Any) -> str:
    """Text of a message content: a string, or the text parts of a multimodal list with placeholders for the rest."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for part in content:
        if part.get("type") == "text":
            pieces.append(part.get("text", ""))
        else:
            # Different images must not share cache blocks, as vLLM's multimodal hashes ensure.
            pieces.append(f"<|{part.get('type')}:{xxhash.xxh64_hexdigest(orjson.dumps(part))}|>")
    return "".join(pieces)


def render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> str:
    """Render chat messages the way a Llama-3 chat template with a generation prompt would."""
    parts = ["<|begin_of_text|>"]
    if tools:
        tools_json = orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode()
        parts.append(f"<|start_header_id|>tools<|end_header_id|>\n\n{tools_json}<|eot_id|>")
    for message in messages:
        body = _content_text(message.get("content"))
        if message.get("tool_calls"):
            body += orjson.dumps(message["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        parts.append(f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n{body}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)
