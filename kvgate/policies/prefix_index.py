"""The prefix blocks each replica probably holds in its KV cache, as learned from where requests were sent."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvgate.endpoints.types import ReplicaMetrics
from kvgate.policies.config import RoutingConfig

# Measured with tracemalloc on CPython 3.11: an OrderedDict entry (~105 B) plus its 64-bit int key (~40 B).
BYTES_PER_BLOCK = 145


def index_capacity_blocks(metrics: ReplicaMetrics, config: RoutingConfig, chars_per_token: float | None = None) -> int:
    """How many prefix blocks a replica's KV cache holds: from its scraped cache config at `chars_per_token` (the
    configured estimate unless given), else the default."""
    tokens = metrics.kv_capacity_tokens  # the cache's size does not change, so a stale scrape still tells it
    if tokens is None:
        return config.index_default_blocks
    return max(1, int(tokens * (chars_per_token or config.chars_per_token) / config.block_chars))


class PrefixIndex:
    """Per endpoint, an LRU set of the chained block hashes it was sent, bounded per endpoint and in total.

    Blocks are recorded deepest first, so a block is always evicted before its ancestors, as vLLM
    evicts a sequence's tail first. Each endpoint's set is therefore closed under prefixes (with
    chained hashes, a block present implies its parents are), which lets `match` binary-search.
    """

    def __init__(self, max_total_blocks: int) -> None:
        self._max_total_blocks = max_total_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._total = 0

    @property
    def total_blocks(self) -> int:
        """Blocks held for all endpoints together."""
        return self._total

    @property
    def approx_bytes(self) -> int:
        """Estimated memory held by the index."""
        return self._total * BYTES_PER_BLOCK

    def sizes(self) -> dict[str, int]:
        """Blocks recorded per endpoint."""
        return {key: len(blocks) for key, blocks in self._blocks.items()}

    def blocks_held(self, endpoint_key: str) -> int:
        """Blocks recorded for one endpoint."""
        blocks = self._blocks.get(endpoint_key)
        return len(blocks) if blocks else 0

    def match(self, endpoint_key: str, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` the endpoint is believed to hold."""
        blocks = self._blocks.get(endpoint_key)
        if not blocks or not hashes or hashes[0] not in blocks:
            return 0
        low, high = 1, len(hashes)  # hashes[low - 1] is held; the answer lies in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            if hashes[middle - 1] in blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def record(self, endpoint_key: str, hashes: Sequence[int], capacity_blocks: int) -> None:
        """Note that the endpoint now holds `hashes` as its most recent blocks; evict beyond its capacity."""
        blocks = self._blocks.setdefault(endpoint_key, OrderedDict())
        held_before = len(blocks)
        for block in reversed(hashes):  # ancestors end up more recent than their descendants
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        _evict_oldest(blocks, len(blocks) - max(1, capacity_blocks))
        self._total += len(blocks) - held_before
        self._enforce_total_bound()

    def forget(self, endpoint_key: str) -> None:
        """Drop everything recorded for an endpoint."""
        blocks = self._blocks.pop(endpoint_key, None)
        if blocks:
            self._total -= len(blocks)

    def _enforce_total_bound(self) -> None:
        """Evict the oldest blocks of the endpoint holding the most until the total bound holds."""
        while self._total > self._max_total_blocks:
            largest = max(self._blocks.values(), key=len)
            evicted = _evict_oldest(largest, self._total - self._max_total_blocks)
            self._total -= evicted


def _evict_oldest(blocks: OrderedDict[int, None], count: int) -> int:
    """Remove up to `count` least recently recorded blocks; return how many were removed."""
    count = min(count, len(blocks))
    for _ in range(count):
        blocks.popitem(last=False)
    return max(count, 0)
