"""The precise index follows BlockStored / BlockRemoved exactly and matches requests in leading tokens."""

from __future__ import annotations

from kvgate.engine.kv_events import BlockRemoved, BlockStored
from kvgate.policies.precise_index import PrecisePrefixIndex, block_keys

PROMPT = tuple(range(100, 140))  # 40 tokens: 10 blocks of 4


def stored(hashes, parent, tokens, size=4, lora=None, extra=None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, lora_name=lora, extra_keys=extra)


def precise_index(**kwargs) -> PrecisePrefixIndex:
    index = PrecisePrefixIndex(**kwargs)
    for key in ("a", "b"):
        index.set_precise(key, True)
    return index


def match(index, tokens=PROMPT, model="m", salt=None, now=0.0, keys=("a", "b")):
    return index.match_tokens(((key, None) for key in keys), tokens, model, salt, now)


def test_stored_blocks_match_in_leading_tokens_of_the_replicas_block_size():
    index = precise_index()
    index.stored("a", stored([1, 2], None, PROMPT[:8]))
    index.stored("a", stored([3], 2, PROMPT[8:12]))
    assert match(index) == {"a": 12, "b": 0}
    assert match(index, PROMPT[:10] + (7,) * 30) == {"a": 8, "b": 0}


def test_removed_blocks_stop_matching_and_the_match_stops_at_the_first_hole():
    index = precise_index()
    index.stored("a", stored([1, 2, 3], None, PROMPT[:12]))
    index.removed("a", BlockRemoved((2,)))
    assert match(index)["a"] == 4
    assert index.blocks_held("a") == 2 and index.total_blocks == 2


def test_blocks_whose_parent_is_unknown_are_not_indexed():
    index = precise_index()
    index.stored("a", stored([5], 99, PROMPT[4:8]))
    assert index.blocks_held("a") == 0


def test_clear_and_forget_drop_a_replicas_blocks():
    index = precise_index()
    index.stored("a", stored([1, 2], None, PROMPT[:8]))
    index.stored("b", stored([1, 2], None, PROMPT[:8]))
    index.clear("a")
    assert match(index) == {"a": 0, "b": 8}
    index.forget("b")
    assert match(index) == {"a": 0} and index.total_blocks == 0


def test_replicas_not_precise_are_left_to_the_approximate_index():
    index = precise_index()
    index.stored("a", stored([1], None, PROMPT[:4]))
    index.set_precise("a", False)
    assert match(index) == {"b": 0}


def test_lora_and_cache_salt_partition_blocks_like_vllm():
    index = precise_index()
    index.stored("a", stored([1, 2], None, PROMPT[:8], lora="sql", extra=(("sql", "s1"), ("sql",))))
    assert match(index, model="sql", salt="s1")["a"] == 8
    assert match(index, model="sql")["a"] == 0
    assert match(index, model="m", salt="s1")["a"] == 0


def test_events_without_extra_keys_key_their_lora_on_every_block():
    index = precise_index()
    index.stored("a", stored([1, 2], None, PROMPT[:8], lora="sql"))
    assert match(index, model="sql")["a"] == 8


def test_a_routed_prompt_counts_as_held_until_the_hold_expires():
    index = precise_index(hold_s=2.0)
    index.stored("a", stored([1], None, PROMPT[:4]))
    match(index, now=10.0)
    index.hold("a", None, PROMPT, "m", None)
    assert match(index, now=11.0)["a"] == 40
    assert match(index, now=12.5)["a"] == 4


def test_the_total_bound_refuses_new_blocks_and_counts_them():
    index = precise_index(max_total_blocks=3)
    index.stored("a", stored([1, 2, 3, 4, 5], None, PROMPT[:20]))
    assert index.blocks_held("a") == 3 and index.dropped_blocks == 2
    assert index.approx_bytes > 0


def test_block_keys_chain_so_equal_blocks_after_different_prefixes_differ():
    first = list(block_keys((1, 2, 3, 4) * 2, 4))
    assert len(first) == 2 and first[0] != first[1]
    assert list(block_keys((1, 2, 3), 4)) == []


def test_the_scraped_block_size_serves_until_an_event_tells_it():
    index = precise_index()
    index.match_tokens([("a", 4)], PROMPT, "m", None, 1.0)
    index.hold("a", 4, PROMPT, "m", None)
    assert index.match_tokens([("a", 4)], PROMPT, "m", None, 2.0) == {"a": 40}
