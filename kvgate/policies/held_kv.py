"""What a replica's in-flight requests hold of its KV cache, counted as the engine counts it.

vLLM holds a prompt block once however many running requests share it, and frees it when the last of them ends
(`vllm:kv_cache_usage_perc` counts such blocks). A gateway that credits each finished request with the mean
running request's blocks errs where prompts share a prefix: a request whose system prompt another one still runs
frees only its own question's blocks. HeldKv counts the blocks of this gateway's in-flight requests by their
prefix keys, so that the change since a replica's last scrape is what the engine's would be.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat

from kvgate.policies.config import RoutingConfig
from kvgate.policies.cost import prompt_tokens, tokens_per_block
from kvgate.policies.types import RequestInfo


@dataclass(frozen=True, slots=True)
class KvFootprint:
    """The KV cache one request takes on its replica: its prompt's prefix blocks, held once with any in-flight request
    that opens the same way, and the tokens that are its alone (the rest of its prompt, a block to grow by)."""

    blocks: tuple[int, ...] = ()
    block_tokens: float = 0.0
    own_tokens: float = 0.0


def kv_footprint(request: RequestInfo, config: RoutingConfig) -> KvFootprint:
    """The footprint of `request`: its prefix blocks at the tokens each holds, and the rest of its prompt beyond them
    (an unhashed tail, a partial block) with one block to grow by as its own."""
    block_tokens = tokens_per_block(config, request)
    prefix = len(request.block_hashes) * block_tokens
    own = max(0.0, prompt_tokens(request, config) - prefix) + block_tokens
    return KvFootprint(request.block_hashes, block_tokens, own)


class HeldKv:
    """The KV tokens one replica's in-flight requests hold between them, each shared prefix block once.

    Prefix blocks are chained (each hash covers every block before it), so a request holding one holds all before
    it: along one request's blocks the count of requests holding each never rises. What it shares with others, and
    what it alone holds, are a leading and a trailing run, found by bisection; the counts change in C-level bulk
    operations, as this runs twice for every request sent."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # prefix block -> in-flight requests holding it (none held: absent)
        self.tokens = 0.0

    def add(self, footprint: KvFootprint) -> None:
        """A request with `footprint` is in flight."""
        blocks, refs = footprint.blocks, self._refs
        shared = self._leading(blocks, refs.__contains__)
        refs.update(zip(blocks[:shared], map((1).__add__, map(refs.__getitem__, blocks[:shared]))))
        refs.update(dict.fromkeys(blocks[shared:], 1))
        self.tokens += (len(blocks) - shared) * footprint.block_tokens + footprint.own_tokens

    def remove(self, footprint: KvFootprint) -> None:
        """A request added with `footprint` ended: the blocks no other in-flight request holds are free."""
        blocks, refs = footprint.blocks, self._refs
        kept = self._leading(blocks, lambda block: refs.get(block, 0) > 1)
        refs.update(zip(blocks[:kept], map((-1).__add__, map(refs.__getitem__, blocks[:kept]))))
        popped = list(map(refs.pop, blocks[kept:], repeat(None)))
        freed = len(popped) - popped.count(None)
        self.tokens = max(0.0, self.tokens - freed * footprint.block_tokens - footprint.own_tokens)

    def freed_by(self, footprints: Sequence[KvFootprint]) -> float:
        """The KV tokens free once the in-flight requests with `footprints` end: the blocks no other request holds,
        and each one's own tokens."""
        theirs = Counter(chain.from_iterable(footprint.blocks for footprint in footprints))
        freed, counted = 0.0, set()
        for footprint in footprints:
            alone = [block for block in footprint.blocks
                     if block not in counted and self._refs.get(block, 0) <= theirs[block]]
            counted.update(alone)
            freed += len(alone) * footprint.block_tokens + footprint.own_tokens
        return freed

    def shared_tokens(self, footprint: KvFootprint) -> float:
        """The tokens of the leading prefix blocks of a request with `footprint` that requests in flight hold already:
        the engine finds them cached and in use, and the request shares them instead of taking blocks of its own."""
        return self._leading(footprint.blocks, self._refs.__contains__) * footprint.block_tokens

    @staticmethod
    def _leading(blocks: tuple[int, ...], held: Callable[[int], bool]) -> int:
        """How many of `blocks`, from the first, satisfy `held` (which, along chained blocks, holds for a leading run).
        Most prompts share none or all of theirs: the ends are asked first."""
        if not blocks or not held(blocks[0]):
            return 0
        if held(blocks[-1]):
            return len(blocks)
        return bisect.bisect_left(range(len(blocks)), True, 1, len(blocks) - 1,
                                  key=lambda index: not held(blocks[index]))
