"""KV events decode in every form vLLM has published: maps and tagged arrays, int and bytes hashes."""

from __future__ import annotations

import msgspec
import pytest

from kvgate.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)


def test_current_map_encoding_round_trips():
    stored = BlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=tuple(range(8)), block_size=4,
                         lora_name="sql", extra_keys=(("sql", "salt"), ("sql",)), medium="GPU")
    batch = decode_batch(7, encode_batch(1.5, [stored, BlockRemoved((11,), "GPU"), AllBlocksCleared()]))
    assert batch.seq == 7 and batch.ts == 1.5
    assert batch.events == (stored, BlockRemoved((11,), "GPU"), AllBlocksCleared())


def test_tagged_arrays_from_older_vllm_with_bytes_hashes():
    payload = msgspec.msgpack.encode([2.0, [
        ["BlockStored", [b"\x01" * 32, b"\x02" * 32], b"\x00" * 32, [1, 2, 3, 4, 5, 6], 3, None, "GPU"],
        ["BlockRemoved", [b"\x01" * 32], "GPU"],
        ["AllBlocksCleared"],
    ]])
    stored, removed, cleared = decode_batch(0, payload).events
    assert stored == BlockStored((b"\x01" * 32, b"\x02" * 32), b"\x00" * 32, (1, 2, 3, 4, 5, 6), 3, medium="GPU")
    assert removed == BlockRemoved((b"\x01" * 32,), "GPU")
    assert cleared == AllBlocksCleared()


def test_map_events_with_every_field_of_new_vllm_and_unknown_types_skipped():
    payload = msgspec.msgpack.encode([3.0, [
        {"type": "BlockStored", "block_hashes": [2**64 - 1], "parent_block_hash": 5, "token_ids": [9, 9],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "SomethingNew", "field": 1},
    ], 0])
    (stored,) = decode_batch(1, payload).events
    assert stored.block_hashes == (2**64 - 1,) and stored.parent_block_hash == 5 and stored.extra_keys == (None,)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0, [7]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]])])
def test_malformed_payloads_raise_one_error_type(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(0, payload)


def test_sequence_frames_are_8_byte_big_endian_with_minus_one_as_end_marker():
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(-1)) == -1
    with pytest.raises(EventDecodeError):
        decode_seq(b"\x01")
