"""The KV block pool with automatic prefix caching: chained block hashes, pinning, LRU eviction."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

import cbor2
import orjson
import xxhash

from kvgate.engine.kv_events import AllBlocksCleared, BlockRemoved, KvEvent
from kvgate.simulator.tokens import TokenSeq

_ROOT_HASH = 0
_UNSEEDED = "vllm-none-hash"  # vLLM's seed of the first block's parent when PYTHONHASHSEED is unset


def extend_block_hashes(
    hashes: list[int], tokens: TokenSeq, block_size: int, lora: str | None, cache_salt: str | None
) -> None:
    """Append to `hashes` the chained hash of every full block of `tokens` not hashed yet.

    Like vLLM, a block's hash covers its parent's hash, its tokens and extra keys: the LoRA adapter on
    every block and the cache salt on the first one only.
    """
    first_extra = orjson.dumps([lora, cache_salt])
    later_extra = orjson.dumps([lora, None])
    for index in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else _ROOT_HASH
        extra = first_extra if index == 0 else later_extra
        block = tokens.span(index * block_size, (index + 1) * block_size)
        hashes.append(xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + extra + block))


class Sha256CborHasher:
    """vLLM's `--prefix-caching-hash-algo sha256_cbor`: sha256 of canonical CBOR, seeded by PYTHONHASHSEED.

    A block's digest is H((parent digest or NONE_HASH, token ids, extra keys)) with NONE_HASH = H(seed);
    the hash the cache is keyed by and events carry is the digest's low 64 bits, as vLLM publishes it.
    """

    def __init__(self, seed: str | None = None) -> None:
        seed = os.environ.get("PYTHONHASHSEED", _UNSEEDED) if seed is None else seed
        self._none_hash = _sha256_cbor(seed)

    def extend(self, hashes: list[int], digests: list[bytes], tokens: TokenSeq, block_size: int,
               lora: str | None, cache_salt: str | None) -> None:
        """Append the hash and digest of every full block of `tokens` not hashed yet."""
        for index in range(len(hashes), len(tokens) // block_size):
            parent = digests[-1] if digests else self._none_hash
            # vLLM tags each extra key with its source in the hash (the events carry them untagged).
            extra: list[tuple[str, str]] = [("lora", lora)] if lora else []
            if cache_salt and index == 0:
                extra.append(("cache_salt", cache_salt))
            digest = _sha256_cbor((parent, tokens.ids(index * block_size, (index + 1) * block_size),
                                   tuple(extra) if extra else None))
            digests.append(digest)
            hashes.append(int.from_bytes(digest[-8:], "big"))


def _sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class PrefixCache:
    """A fixed pool of KV blocks; full blocks stay addressable by hash until evicted.

    Blocks referenced by running sequences are pinned. A cached block whose last reference goes away
    stays cached but evictable, and the least recently released one is evicted first when a fresh
    block is needed. Blocks are counted, not materialised: a sequence holds a list whose entries are
    a cached block's hash, or None for a private block (partial, or a duplicate of a cached one).
    """

    def __init__(self, num_blocks: int, enable_caching: bool, events: list[KvEvent] | None = None) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.evictions = 0
        self.events = events  # where evictions and clears are reported, in order, when KV events are on
        self._refs: dict[int, int] = {}  # cached block hash -> running sequences referencing it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no reference, LRU first
        self._pinned = 0  # distinct blocks referenced by at least one running sequence

    @property
    def pinned_blocks(self) -> int:
        """Blocks in use by running sequences (what vLLM reports as KV cache usage)."""
        return self._pinned

    @property
    def cached_blocks(self) -> int:
        """Blocks addressable by hash, pinned or evictable."""
        return len(self._refs)

    def cached_hashes(self) -> frozenset[int]:
        """The hashes of every cached block, pinned or evictable."""
        return frozenset(self._refs)

    def longest_hit(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of `hashes` (at most `max_blocks`) are cached."""
        if not self.enable_caching:
            return 0
        hits = 0
        for block_hash in hashes[:max_blocks]:
            if block_hash not in self._refs:
                break
            hits += 1
        return hits

    def can_allocate(self, hit_hashes: Sequence[int], new_blocks: int) -> bool:
        """Whether pinning `hit_hashes` and allocating `new_blocks` fresh blocks fits without preemption."""
        # Hit blocks that are evictable now become pinned, so they cannot be evicted to make room.
        reclaimed = sum(1 for block_hash in hit_hashes if self._refs[block_hash] == 0)
        return new_blocks <= self.num_blocks - self._pinned - reclaimed

    def pin(self, block_hash: int) -> None:
        """Reference a cached block (a prefix cache hit)."""
        refs = self._refs[block_hash]
        if refs == 0:
            del self._evictable[block_hash]
            self._pinned += 1  # a block shared by running sequences is counted once
        self._refs[block_hash] = refs + 1

    def allocate(self) -> None:
        """Take one private block, evicting the least recently used cached block when none is free."""
        if self._pinned >= self.num_blocks:
            raise RuntimeError("KV cache exhausted: the scheduler must preempt before allocating")
        if self._pinned + len(self._evictable) >= self.num_blocks:
            victim, _ = self._evictable.popitem(last=False)
            del self._refs[victim]
            self.evictions += 1
            if self.events is not None:
                self.events.append(BlockRemoved((victim,), medium="GPU"))
        self._pinned += 1

    def register(self, block_hash: int) -> bool:
        """Publish a full private block under its hash; False (it stays private) if that hash is cached already."""
        if not self.enable_caching or block_hash in self._refs:
            return False
        self._refs[block_hash] = 1
        return True

    def release(self, held: Sequence[int | None]) -> None:
        """Drop a sequence's references; its tail blocks become the first candidates for eviction, as in vLLM."""
        for block_hash in reversed(held):
            if block_hash is None:
                self._pinned -= 1
                continue
            refs = self._refs[block_hash] - 1
            self._refs[block_hash] = refs
            if refs == 0:
                self._pinned -= 1
                self._evictable[block_hash] = None

    def clear_unpinned(self) -> None:
        """Forget every cached block no running sequence references (all of them: AllBlocksCleared)."""
        if self.events is not None and self._evictable:
            cleared_all = len(self._evictable) == len(self._refs)
            self.events.append(AllBlocksCleared() if cleared_all else BlockRemoved(tuple(self._evictable), "GPU"))
        for block_hash in self._evictable:
            del self._refs[block_hash]
        self._evictable.clear()
