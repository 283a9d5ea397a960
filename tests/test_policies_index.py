"""PrefixIndex: leading-block matching, per-endpoint LRU capacity, purge, and the global bound."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.endpoints.types import ReplicaMetrics
from kvgate.policies import PrefixIndex, RoutingConfig, index_capacity_blocks
from kvgate.policies.prefix_keys import chain_hashes
from kvgate.policies.prefix_index import BYTES_PER_BLOCK


def path(name: str, blocks: int) -> tuple[int, ...]:
    """Chained hashes of a distinct prompt `blocks` blocks long."""
    return chain_hashes(name.encode().ljust(blocks * 8, b"."), 0, 8)


def test_match_counts_leading_blocks_held() -> None:
    index = PrefixIndex(max_total_blocks=1000)
    first = path("a", 6)
    index.record("e1", first[:4], capacity_blocks=100)
    assert index.match("e1", first) == 4
    assert index.match("e1", first[:2]) == 2
    assert index.match("e1", path("b", 6)) == 0
    assert index.match("e2", first) == 0
    assert index.match("e1", ()) == 0


def test_capacity_evicts_deepest_blocks_first() -> None:
    index = PrefixIndex(max_total_blocks=1000)
    first, second = path("a", 4), path("b", 2)
    index.record("e1", first, capacity_blocks=4)
    index.record("e1", second, capacity_blocks=4)
    assert index.blocks_held("e1") == 4
    assert index.match("e1", second) == 2
    assert index.match("e1", first) == 2  # its tail went first, as vLLM evicts a sequence's tail


def test_recording_again_refreshes_a_prefix() -> None:
    index = PrefixIndex(max_total_blocks=1000)
    first, second, third = path("a", 2), path("b", 2), path("c", 2)
    index.record("e1", first, capacity_blocks=4)
    index.record("e1", second, capacity_blocks=4)
    index.record("e1", first, capacity_blocks=4)
    index.record("e1", third, capacity_blocks=4)
    assert (index.match("e1", first), index.match("e1", second), index.match("e1", third)) == (2, 0, 2)


def test_shared_leading_blocks_are_held_once() -> None:
    index = PrefixIndex(max_total_blocks=1000)
    turn1 = path("conversation", 3)
    turn2 = chain_hashes(b"conversation".ljust(24, b".") + b"next turn", 0, 8)
    assert turn2[:3] == turn1
    index.record("e1", turn1, capacity_blocks=100)
    index.record("e1", turn2, capacity_blocks=100)
    assert index.total_blocks == len(turn2)


def test_forget_purges_an_endpoint() -> None:
    index = PrefixIndex(max_total_blocks=1000)
    index.record("e1", path("a", 5), capacity_blocks=100)
    index.record("e2", path("a", 5), capacity_blocks=100)
    index.forget("e1")
    index.forget("never-seen")
    assert index.match("e1", path("a", 5)) == 0
    assert index.match("e2", path("a", 5)) == 5
    assert index.total_blocks == 5
    assert index.approx_bytes == 5 * BYTES_PER_BLOCK


def test_global_bound_evicts_from_the_largest_endpoint() -> None:
    index = PrefixIndex(max_total_blocks=10)
    index.record("big", path("a", 8), capacity_blocks=100)
    index.record("small", path("b", 4), capacity_blocks=100)
    assert index.total_blocks == 10
    assert (index.blocks_held("big"), index.blocks_held("small")) == (6, 4)
    assert index.match("big", path("a", 8)) == 6


def test_total_stays_within_both_bounds_under_random_traffic() -> None:
    index = PrefixIndex(max_total_blocks=300)
    rng = random.Random(7)
    for step in range(2000):
        endpoint = f"e{rng.randrange(5)}"
        index.record(endpoint, path(f"p{rng.randrange(200)}", rng.randrange(1, 40)), capacity_blocks=100)
        if step % 500 == 499:
            index.forget(endpoint)
        held = [index.blocks_held(f"e{i}") for i in range(5)]
        assert index.total_blocks == sum(held) <= 300
        assert max(held) <= 100


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(1, 12), st.integers(1, 30)),
        min_size=1,
        max_size=40,
    )
)
def test_binary_search_match_equals_a_linear_scan(records: list[tuple[int, int, int, int]]) -> None:
    index = PrefixIndex(max_total_blocks=60)
    for endpoint, prompt, length, capacity in records:
        index.record(f"e{endpoint}", path(f"p{prompt}", length), capacity_blocks=capacity)
    for endpoint in range(3):
        for prompt in range(7):
            hashes = path(f"p{prompt}", 12)
            held = [index.match(f"e{endpoint}", (block,)) == 1 for block in hashes]  # membership of each block
            linear = held.index(False) if False in held else len(hashes)
            assert index.match(f"e{endpoint}", hashes) == linear


def test_capacity_comes_from_the_scraped_kv_cache_size() -> None:
    config = RoutingConfig(block_chars=64, chars_per_token=4.0, index_default_blocks=123)
    scraped = ReplicaMetrics(block_size=16, num_gpu_blocks=4096, stale=True)
    assert index_capacity_blocks(scraped, config) == 16 * 4096 * 4 // 64
    assert index_capacity_blocks(ReplicaMetrics(), config) == 123
