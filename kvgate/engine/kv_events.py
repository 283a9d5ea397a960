"""vLLM's KV-cache events on the wire: three-frame ZMQ messages carrying a msgpack event batch.

A message is `[topic, sequence (8 bytes, big-endian), payload]`; the payload is
`[ts, [event, ...], data_parallel_rank]`. Current vLLM encodes each event as a map with a `type` key;
older releases sent tagged arrays `[tag, field, ...]` in declaration order. Block hashes are ints (the
low 64 bits of the digest) or raw digest bytes. Decoding accepts every form; encoding (the simulator)
writes the current one.

An engine's replay endpoint (a ROUTER socket) answers a request `[b"", start seq]` with every batch it still
buffers from `start` on, as `[b"", seq, payload]` (some publishers add the topic frame), then an end marker:
seq -1 and an empty payload. `replay` reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

BlockHash = int | bytes
END_OF_REPLAY = -1  # sequence number of the replay endpoint's end marker

_ARRAY_FIELDS = {  # field order of the tagged-array encoding, after the tag
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine cached, in chain order; `token_ids` holds `block_size` tokens per block."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # per block: that block's extra hash keys (None for none)
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One message's events, with its publisher's sequence number."""

    seq: int
    ts: float
    events: tuple[KvEvent, ...]


_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


def decode_seq(frame: bytes) -> int:
    """A sequence frame: 8 bytes big-endian (signed, so the replay end marker reads -1)."""
    if len(frame) != 8:
        raise EventDecodeError(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame."""
    return seq.to_bytes(8, "big", signed=True)


async def replay(address: str, start: int, timeout_s: float) -> AsyncIterator[tuple[int, bytes]]:
    """(seq, payload) of every batch the replay endpoint at `address` buffers from `start` on, oldest first, up to
    its end marker; TimeoutError when an answer takes over `timeout_s`. Close it (`contextlib.aclosing`) when
    leaving early."""
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    try:
        await dealer.send_multipart((b"", encode_seq(start)))
        while True:
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow the caller's cancel
                frames = await dealer.recv_multipart()
            if len(frames) < 2:
                raise EventDecodeError(f"replay answer of {len(frames)} frames")
            seq, payload = decode_seq(frames[-2]), frames[-1]
            if seq == END_OF_REPLAY or not payload:
                return
            yield seq, payload
    finally:
        dealer.close(linger=0)


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """Decode a msgpack event batch; raises EventDecodeError for anything malformed."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise EventDecodeError("payload is not an event batch [ts, [events], ...]")
    ts = raw[0] if isinstance(raw[0], (int, float)) else 0.0
    try:
        events = tuple(event for event in map(_event, raw[1]) if event is not None)
    except (TypeError, ValueError, KeyError) as exc:
        raise EventDecodeError(f"malformed event: {exc}") from None
    return EventBatch(seq=seq, ts=float(ts), events=events)


def encode_batch(ts: float, events: Sequence[KvEvent], data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload current vLLM publishes: events as maps with a `type` key."""
    return _encoder.encode([ts, [_as_map(event) for event in events], data_parallel_rank])


def _event(raw: Any) -> KvEvent | None:
    """One event from either encoding; None for an event type kvgate does not use."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_ARRAY_FIELDS.get(kind, ()), raw[1:]))
    else:
        raise ValueError(f"event is neither a map nor a tagged array: {type(raw).__name__}")
    if kind == "BlockStored":
        tokens = fields["token_ids"]
        extra = fields.get("extra_keys")
        return BlockStored(
            block_hashes=_hashes(fields["block_hashes"]), parent_block_hash=_hash(fields.get("parent_block_hash")),
            token_ids=tuple(int(token) for token in tokens), block_size=int(fields["block_size"]),
            lora_name=fields.get("lora_name"),
            extra_keys=None if extra is None else tuple(None if keys is None else tuple(keys) for keys in extra),
            medium=fields.get("medium"))
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(fields["block_hashes"]), medium=fields.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _hashes(raw: Any) -> tuple[BlockHash, ...]:
    if not isinstance(raw, (list, tuple)):
        raise ValueError("block_hashes is not an array")
    return tuple(_hash(value) for value in raw)  # type: ignore[misc]


def _hash(value: Any) -> BlockHash | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"block hash of type {type(value).__name__}")


def _as_map(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": event.medium or "GPU",
                "lora_name": event.lora_name,
                "extra_keys": None if event.extra_keys is None else list(event.extra_keys)}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium or "GPU"}
    return {"type": "AllBlocksCleared"}
