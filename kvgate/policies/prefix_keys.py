"""Prefix block hashing: turns a request body into chained hashes of its prompt's leading blocks.

The prompt is serialized to bytes (UTF-8 text; token ids as 4-byte little-endian integers, so one
16-token vLLM block is one 64-byte prefix block), cut into blocks of `config.block_chars` bytes,
and each block is hashed with xxh3_64 seeded by its parent's hash; the first block's seed is the
hash of the model name and `cache_salt`. A block hash thus names the whole prefix up to it, as
vLLM's own block hashes do. xxh3_64 is used rather than xxh64: equal on 64-byte blocks and about
4x faster on long inputs such as image digests.

Only full blocks are hashed, like vLLM, which caches only full blocks: a conversation's next turn
then shares every hash of the previous turn's prompt. A prompt shorter than one block gets one
hash of all its bytes, so that short prompts still spread by content.

Only the first `max_blocks` blocks are serialized and hashed, so the cost is bounded by
`max_blocks * block_chars` bytes whatever the prompt's size.

A chat request also gets its anchor: the full blocks of its instructions (tool definitions and the
leading system or developer messages), which its tenant's conversations share, when a conversation's
own messages follow them. Cold placement keys on it. A chat without instructions has no anchor: its
first user turn is the conversation's own context, cached where that turn went; its opening (the full
blocks up to that turn's end) bounds how deep its placement key may reach, so that every later turn
keys where the first did.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import orjson
from xxhash import xxh3_64_digest, xxh3_64_intdigest

from kvgate.policies.config import RoutingConfig
from kvgate.policies.types import DEFAULT_FLOW, RequestInfo



class _Mark:
    """Marks a position among a prompt's parts (the end of a chat's instructions, of its first own message);
    serializes to nothing."""


_ANCHOR = _Mark()
_OPENING = _Mark()
PromptPart = str | bytes | list[Any] | _Mark  # text, pre-serialized bytes, token ids, or a mark
KINDS = ("chat", "completion", "embedding")
INSTRUCTION_ROLES = ("system", "developer")  # a chat's leading messages of these roles are its instructions
TOKEN_BYTES = 4
_SEPARATOR = "\x1e"  # between messages and between the prompts of a batch
_FIELD_SEPARATOR = "\x1f"  # between a message's role, content and other fields
_NON_TEXT_MARKER = b"\x1d"  # precedes the digest of an image, audio or other non-text part


def prompt_parts(kind: str, body: dict[str, Any]) -> Iterator[PromptPart]:
    """The pieces of a request's prompt in order; their concatenation is what gets hashed."""
    if kind == "chat":
        yield from _chat_parts(body)
    elif kind == "completion":
        yield from _prompt_input_parts(body.get("prompt"))
    elif kind == "embedding":
        if "input" in body:
            yield from _prompt_input_parts(body.get("input"))
        else:
            yield from _chat_parts(body)
    else:
        raise ValueError(f"unknown request kind {kind!r}; expected one of {KINDS}")


def block_hashes(model: str, body: dict[str, Any], kind: str, config: RoutingConfig) -> tuple[int, ...]:
    """Chained hashes of the prompt's leading blocks (at most `config.max_blocks`)."""
    return _hash_prompt(model, body, kind, config).hashes


def build_request_info(
    kind: str,
    body: dict[str, Any],
    priority_class: str,
    config: RoutingConfig,
    body_bytes: int = 0,
    flow: str = DEFAULT_FLOW,
) -> RequestInfo:
    """Everything routing needs from a parsed body whose `model` the router has checked is a string."""
    model = body["model"]
    prompt = _hash_prompt(model, body, kind, config)
    return RequestInfo(
        model=model,
        priority_class=priority_class,
        block_hashes=prompt.hashes,
        anchor_blocks=prompt.marks.get(_ANCHOR, 0) // config.block_chars,
        opening_blocks=prompt.marks.get(_OPENING, 0) // config.block_chars,
        prompt_chars=prompt.size,
        stream=body.get("stream") is True,
        body_bytes=body_bytes,
        flow=flow,
        cache_salt=salt if isinstance(salt := body.get("cache_salt"), str) and salt else None,
    )


def chain_hashes(data: bytes, seed: int, block_size: int) -> tuple[int, ...]:
    """Hash each full `block_size` slice of `data`, seeding each with the previous hash."""
    if len(data) < block_size:
        return (xxh3_64_intdigest(data, seed),) if data else ()
    parent = seed
    return tuple(
        [parent := xxh3_64_intdigest(data[i : i + block_size], parent) for i in range(0, len(data) - block_size + 1, block_size)]
    )


def prefix_seed(model: str, cache_salt: object = None) -> int:
    """Seed of a request's first block: its model and cache salt, which partition vLLM's cache."""
    salt = cache_salt if isinstance(cache_salt, str) else ""
    return xxh3_64_intdigest(_utf8(model) + b"\x00" + _utf8(salt))


class _HashedPrompt(NamedTuple):
    hashes: tuple[int, ...]
    size: int  # of the whole serialized prompt, text in characters
    marks: dict[_Mark, int]  # serialized bytes before each mark the prompt has, within the hashed bytes


def _hash_prompt(model: str, body: dict[str, Any], kind: str, config: RoutingConfig) -> _HashedPrompt:
    """Block hashes, total serialized size and marks of the prompt."""
    data, size, marks = _leading_bytes(prompt_parts(kind, body), config.max_blocks * config.block_chars)
    return _HashedPrompt(chain_hashes(data, prefix_seed(model, body.get("cache_salt")), config.block_chars), size,
                         {mark: min(position, len(data)) for mark, position in marks.items()})


def _leading_bytes(parts: Iterator[PromptPart], limit: int) -> tuple[bytes, int, dict[_Mark, int]]:
    """The first `limit` bytes of the serialized parts, the size of them all (text in characters) and the
    number of bytes before each mark."""
    pieces: list[bytes] = []
    kept = 0
    size = 0
    marks: dict[_Mark, int] = {}
    for part in parts:
        if isinstance(part, _Mark):
            marks[part] = kept
            continue
        if isinstance(part, list):
            size += len(part) * TOKEN_BYTES
        else:
            size += len(part)
        if kept < limit:
            piece = _serialize(part, limit - kept)
            pieces.append(piece)
            kept += len(piece)
    return b"".join(pieces)[:limit], size, marks


def _serialize(part: PromptPart, room: int) -> bytes:
    """At least the first `room` bytes of a part (or all of it), slicing before encoding."""
    if isinstance(part, str):
        return _utf8(part[:room])  # a character is at least one byte
    if isinstance(part, bytes):
        return part[:room]
    return _token_bytes(part[: room // TOKEN_BYTES + 1])


def _token_bytes(token_ids: list[Any]) -> bytes:
    """Token ids as little-endian uint32s; an invalid list (floats, negatives) contributes nothing."""
    try:
        packed = array("I", token_ids)
    except (TypeError, OverflowError):
        return b""
    if sys.byteorder == "big":
        packed.byteswap()  # every gateway replica must produce the same bytes
    return packed.tobytes()


def _utf8(text: str) -> bytes:
    # JSON may carry lone surrogates, which strict UTF-8 refuses.
    return text.encode("utf-8", "surrogatepass")


def _prompt_input_parts(prompt: object) -> Iterator[PromptPart]:
    """Parts of a completions `prompt` or embeddings `input`: a string, strings, token ids, or token-id lists."""
    if isinstance(prompt, str):
        yield prompt
        return
    if not isinstance(prompt, list) or not prompt:
        return
    if not isinstance(prompt[0], (str, list)):
        yield prompt  # one prompt of token ids
        return
    # A batch: its prompts in order, so that a batch of one hashes like the bare prompt.
    for position, item in enumerate(prompt):
        if position:
            yield _SEPARATOR
        if isinstance(item, (str, list)):
            yield item


def _chat_parts(body: dict[str, Any]) -> Iterator[PromptPart]:
    """Tool definitions, then each message: role, content, then its other fields (tool calls, name)."""
    tools = body.get("tools")
    if tools:
        yield _stable_json(tools)
    opened = False
    for message in _dicts_in(body.get("messages")):
        role = message.get("role")
        first_own = not opened and role not in INSTRUCTION_ROLES
        if first_own:
            yield _ANCHOR  # the instructions end where the conversation's own messages begin
        yield _SEPARATOR
        yield role if isinstance(role, str) else ""
        yield _FIELD_SEPARATOR
        yield from _content_parts(message.get("content"))
        others = {name: value for name, value in message.items() if name not in ("role", "content")}
        if others:
            yield _FIELD_SEPARATOR
            yield _stable_json(others)
        if first_own:
            yield _OPENING  # and its first own message ends here: every later turn repeats it
            opened = True


def instruction_messages(body: Mapping[str, Any]) -> int:
    """How many leading messages of a chat are its instructions (its anchor's messages): 0 unless a message of its
    own follows them."""
    messages = list(_dicts_in(body.get("messages")))
    return next((at for at, message in enumerate(messages) if message.get("role") not in INSTRUCTION_ROLES), 0)


def _content_parts(content: object) -> Iterator[PromptPart]:
    """A message's text; a non-text part (image, audio) contributes a digest so that different media differ."""
    if isinstance(content, str):
        yield content
        return
    for part in _dicts_in(content):
        text = part.get("text")
        if isinstance(text, str):
            yield text
        else:
            yield _NON_TEXT_MARKER + xxh3_64_digest(_stable_json(part))


def _dicts_in(items: object) -> Iterator[dict[str, Any]]:
    """The objects in a JSON array, skipping anything else; nothing when it is not an array."""
    if isinstance(items, list):
        yield from (item for item in items if isinstance(item, dict))


def _stable_json(value: object) -> bytes:
    """A canonical serialization (sorted keys); values JSON cannot express contribute nothing."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return b""
