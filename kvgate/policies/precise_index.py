"""What each replica's KV cache really holds, rebuilt from its engine's KV-cache events.

Blocks are keyed by kvgate's own chained hash of their token ids (xxh3_64 of the block's tokens as
uint32 and its extra keys, seeded by the parent block's key), so the index never depends on the
engine's hash function or seed; a map from the engine's block hash to that key serves removals. A
request's keys are computed the same way from its token ids, with the LoRA adapter on every block and
`cache_salt` on the first one, as vLLM keys its blocks.

Between a routing decision and the engine's events about it, the blocks the request will store count
as held for `hold_s`, so a burst of one new prefix does not scatter before the first event arrives.

Pure: no I/O, no clock (times come in as arguments). The event subscriber (endpoints/kv_events.py)
feeds it and says which replicas' state is complete ("precise"); a replica that is not gets None from
`match_tokens` and is routed on the approximate index.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest

from kvgate.engine.kv_events import BlockHash, BlockRemoved, BlockStored

_TOKEN_BYTES = 4
# Measured with tracemalloc on CPython 3.11: a held-key entry, an engine-hash entry and both ints.
BYTES_PER_BLOCK = 260


def block_keys(token_ids: Sequence[int], block_size: int, lora: str | None = None,
               cache_salt: str | None = None) -> Iterator[int]:
    """kvgate's chained key of each full `block_size` block of `token_ids`, lazily, first block first."""
    packed = _packed(token_ids)
    width = block_size * _TOKEN_BYTES
    first_extra = _request_extra_keys(lora, cache_salt)
    later_extra = _request_extra_keys(lora, None)
    parent = 0
    for start in range(0, len(token_ids) // block_size * width, width):
        block = packed[start:start + width]
        extra = first_extra if start == 0 else later_extra
        parent = xxh3_64_intdigest(bytes(block) + extra if extra else block, parent)
        yield parent


@dataclass
class _Replica:
    """One replica's blocks as its events describe them."""

    precise: bool = False
    block_size: int | None = None
    held: dict[int, int] = field(default_factory=dict)  # key -> engine hashes naming it
    by_engine: dict[BlockHash, int] = field(default_factory=dict)
    loras: set[str] = field(default_factory=set)
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> until (expiry order)
    stored_since_clear: int = 0


class PrecisePrefixIndex:
    """Per replica, the blocks its engine reported storing and not yet removing, bounded in total."""

    def __init__(self, max_total_blocks: int = 2_000_000, hold_s: float = 30.0) -> None:
        self._max_total_blocks = max_total_blocks
        self._hold_s = hold_s
        self._replicas: dict[str, _Replica] = {}
        self._total = 0
        self._now = 0.0  # time of the latest match: the pick a following hold() belongs to
        # The latest match's block keys, which the hold() that follows it for the same prompt reuses.
        self._chains: tuple[Sequence[int], dict[tuple[int, str | None], _LazyKeys]] | None = None
        self.dropped_blocks = 0  # stores refused by the total bound

    @property
    def total_blocks(self) -> int:
        """Blocks held for all replicas together."""
        return self._total

    @property
    def approx_bytes(self) -> int:
        """Estimated memory of the index."""
        return self._total * BYTES_PER_BLOCK

    def blocks_held(self, key: str) -> int:
        """Blocks a replica holds according to its events."""
        replica = self._replicas.get(key)
        return len(replica.held) if replica else 0

    def held_keys(self, key: str) -> frozenset[int]:
        """The keys of the blocks a replica holds (for comparing the belief with the engine)."""
        replica = self._replicas.get(key)
        return frozenset(replica.held) if replica else frozenset()

    def engine_hashes(self, key: str) -> frozenset[BlockHash]:
        """The engine's hashes of the blocks a replica holds (for comparing the belief with the engine)."""
        replica = self._replicas.get(key)
        return frozenset(replica.by_engine) if replica else frozenset()

    def block_size(self, key: str) -> int | None:
        """The replica's KV block size in tokens, once an event told it."""
        replica = self._replicas.get(key)
        return replica.block_size if replica else None

    def stored_since_clear(self, key: str) -> int:
        """Blocks stored since the replica's state was last cleared."""
        replica = self._replicas.get(key)
        return replica.stored_since_clear if replica else 0

    def is_precise(self, key: str) -> bool:
        """Whether the replica's state is complete, so its match is the truth."""
        replica = self._replicas.get(key)
        return bool(replica and replica.precise)

    def set_precise(self, key: str, precise: bool) -> None:
        """Mark a replica's state complete (or not: it is then routed approximately)."""
        self._replicas.setdefault(key, _Replica()).precise = precise

    def stored(self, key: str, event: BlockStored) -> None:
        """Apply a BlockStored event: its blocks chain onto the parent the replica already holds."""
        replica = self._replicas.setdefault(key, _Replica())
        replica.block_size = event.block_size
        if event.lora_name:
            replica.loras.add(event.lora_name)
        if event.parent_block_hash is None:
            parent = 0
        elif (found := replica.by_engine.get(event.parent_block_hash)) is not None:
            parent = found
        else:
            return  # its parent is unknown to us, so no request can match through these blocks
        size = event.block_size
        for index, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * size:(index + 1) * size]
            if len(tokens) < size:
                break
            parent = _block_key(parent, tokens, _event_extra_keys(event, index))
            if engine_hash in replica.by_engine:
                continue
            if self._total >= self._max_total_blocks:
                self.dropped_blocks += 1
                continue
            replica.by_engine[engine_hash] = parent
            replica.held[parent] = replica.held.get(parent, 0) + 1
            replica.pending.pop(parent, None)
            replica.stored_since_clear += 1
            self._total += 1

    def removed(self, key: str, event: BlockRemoved) -> None:
        """Apply a BlockRemoved event."""
        replica = self._replicas.get(key)
        if replica is None:
            return
        for engine_hash in event.block_hashes:
            block = replica.by_engine.pop(engine_hash, None)
            if block is None:
                continue
            self._total -= 1
            refs = replica.held[block] - 1
            if refs:
                replica.held[block] = refs
            else:
                del replica.held[block]

    def clear(self, key: str) -> None:
        """Forget everything about a replica's blocks (AllBlocksCleared, a restart, a lost connection)."""
        replica = self._replicas.get(key)
        if replica is None:
            return
        self._total -= len(replica.by_engine)
        replica.held.clear()
        replica.by_engine.clear()
        replica.pending.clear()
        replica.stored_since_clear = 0

    def forget(self, key: str) -> None:
        """Drop a replica that left the fleet."""
        self.clear(key)
        self._replicas.pop(key, None)

    def match_tokens(self, replicas: Iterable[tuple[str, int | None]], token_ids: Sequence[int], model: str,
                     cache_salt: str | None, now: float) -> dict[str, int]:
        """Leading prompt tokens each precise replica holds (or will hold: recently routed there).

        `replicas` are (key, block size from its metrics); the size its events report wins. Replicas whose
        state is not precise are left out: the caller routes them approximately.
        """
        self._now = now
        found: dict[str, int] = {}
        chains: dict[tuple[int, str | None], _LazyKeys] = {}  # replicas sharing a block size share the hashing
        self._chains = (token_ids, chains)
        for key, scraped_block_size in replicas:
            replica = self._replicas.get(key)
            if replica is None or not replica.precise:
                continue
            block_size = replica.block_size or scraped_block_size
            if not block_size:
                found[key] = 0
                continue
            lora = model if model in replica.loras else None
            chain = chains.get((block_size, lora))
            if chain is None:
                chain = chains[block_size, lora] = _LazyKeys(block_keys(token_ids, block_size, lora, cache_salt))
            found[key] = _leading_held(chain, replica, now) * block_size
        return found

    def hold(self, key: str, scraped_block_size: int | None, token_ids: Sequence[int], model: str,
             cache_salt: str | None) -> None:
        """The replica was just sent this prompt: count its blocks as held for `hold_s` from the last match."""
        replica = self._replicas.get(key)
        block_size = replica.block_size or scraped_block_size if replica else None
        if replica is None or not replica.precise or not block_size:
            return
        until = self._now + self._hold_s
        pending = replica.pending
        while pending and next(iter(pending.values())) <= self._now:
            pending.popitem(last=False)
        lora = model if model in replica.loras else None
        chain = self._chains[1].get((block_size, lora)) if self._chains and self._chains[0] is token_ids else None
        for block in chain.all() if chain else block_keys(token_ids, block_size, lora, cache_salt):
            if block not in replica.held:
                pending[block] = until
                pending.move_to_end(block)

    def describe(self, key: str) -> dict[str, Any]:
        """A replica's state for /debug/fleet."""
        replica = self._replicas.get(key) or _Replica()
        return {"precise": replica.precise, "blocks_held": len(replica.held), "block_size": replica.block_size,
                "pending_blocks": len(replica.pending)}


class _LazyKeys:
    """A request's block keys for one block size, computed only as far as some replica's match reaches."""

    def __init__(self, keys: Iterator[int]) -> None:
        self._source = keys
        self._keys: list[int] = []

    def all(self) -> list[int]:
        """Every key of the prompt."""
        self._keys.extend(self._source)
        return self._keys

    def get(self, index: int) -> int | None:
        while len(self._keys) <= index:
            nxt = next(self._source, None)
            if nxt is None:
                return None
            self._keys.append(nxt)
        return self._keys[index]


def _leading_held(chain: _LazyKeys, replica: _Replica, now: float) -> int:
    """How many of the chain's leading blocks the replica holds or will hold soon."""
    count = 0
    while (block := chain.get(count)) is not None:
        if block not in replica.held and replica.pending.get(block, 0.0) <= now:
            break
        count += 1
    return count


def _block_key(parent: int, tokens: Sequence[int], extra: bytes) -> int:
    return xxh3_64_intdigest(bytes(_packed(tokens)) + extra, parent)


def _packed(tokens: Sequence[int]) -> memoryview:
    """Token ids as little-endian uint32, the bytes every gateway replica hashes alike."""
    packed = array("I", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return memoryview(packed).cast("B")


def _request_extra_keys(lora: str | None, cache_salt: str | None) -> bytes:
    """A request block's extra keys as vLLM orders them: the LoRA name, then the salt (first block only)."""
    keys = [value for value in (lora, cache_salt) if value]
    return _extra_bytes(keys or None)


def _event_extra_keys(event: BlockStored, index: int) -> bytes:
    """A stored block's extra keys: from the event when it carries them, else its LoRA name."""
    if event.extra_keys is not None and index < len(event.extra_keys):
        keys = event.extra_keys[index]
        return _extra_bytes(list(keys) if keys else None)
    return _extra_bytes([event.lora_name] if event.lora_name else None)


def _extra_bytes(keys: list[Any] | None) -> bytes:
    if not keys:
        return b""
    return orjson.dumps(keys, default=lambda value: value.hex() if isinstance(value, bytes) else str(value))
