"""Prefix block hashing: request shapes, chaining, seeds, the block cap and its cost."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from kvgate.policies import KINDS, RoutingConfig, block_hashes, build_request_info, prompt_parts
from kvgate.policies.prefix_keys import chain_hashes, prefix_seed

CONFIG = RoutingConfig()
BLOCK = CONFIG.block_chars


def text_of(blocks: float, seed: str = "a") -> str:
    """ASCII text `blocks` blocks long, different for each seed."""
    unit = f"{seed} lorem ipsum dolor sit amet "
    length = int(blocks * BLOCK)
    return (unit * (length // len(unit) + 1))[:length]


def chat(messages: list[Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, **fields}


def chat_hashes(body: dict[str, Any], config: RoutingConfig = CONFIG) -> tuple[int, ...]:
    return block_hashes(body["model"], body, "chat", config)


def completion_hashes(prompt: Any, model: str = "m") -> tuple[int, ...]:
    return block_hashes(model, {"model": model, "prompt": prompt}, "completion", CONFIG)


def test_identical_conversations_give_identical_hashes() -> None:
    messages = [{"role": "system", "content": text_of(3)}, {"role": "user", "content": text_of(2, "q")}]
    assert chat_hashes(chat(messages)) == chat_hashes(chat([dict(m) for m in messages]))
    assert len(chat_hashes(chat(messages))) >= 5


def test_next_turn_shares_every_block_of_the_previous_prompt() -> None:
    turn1 = [{"role": "system", "content": text_of(3)}, {"role": "user", "content": text_of(2.5, "q1")}]
    turn2 = turn1 + [{"role": "assistant", "content": text_of(1.7, "a1")}, {"role": "user", "content": "more?"}]
    first, second = chat_hashes(chat(turn1)), chat_hashes(chat(turn2))
    assert len(second) > len(first) >= 5
    assert second[: len(first)] == first


def test_cache_salt_and_model_change_every_hash() -> None:
    messages = [{"role": "user", "content": text_of(4)}]
    plain = chat_hashes(chat(messages))
    salted = chat_hashes(chat(messages, cache_salt="tenant-a"))
    other_salt = chat_hashes(chat(messages, cache_salt="tenant-b"))
    other_model = block_hashes("m2", chat(messages), "chat", CONFIG)
    for variant in (salted, other_salt, other_model):
        assert len(variant) == len(plain)
        assert not set(variant) & set(plain)
    assert not set(salted) & set(other_salt)


def test_each_block_hash_chains_its_parent() -> None:
    base = text_of(6)
    changed_early = "X" + base[1:]
    changed_third = base[: 2 * BLOCK] + "X" + base[2 * BLOCK + 1 :]
    hashes = completion_hashes(base)
    assert len(hashes) == 6
    assert not set(completion_hashes(changed_early)) & set(hashes)  # a change reaches every later block
    assert completion_hashes(changed_third)[:2] == hashes[:2]
    assert not set(completion_hashes(changed_third)[2:]) & set(hashes)


def test_only_full_blocks_are_hashed_except_a_prompt_shorter_than_one_block() -> None:
    assert len(completion_hashes(text_of(2.5))) == 2
    assert completion_hashes(text_of(2.5)) == completion_hashes(text_of(2))
    assert len(completion_hashes("hi")) == 1
    assert completion_hashes("hi") != completion_hashes("ho")
    assert completion_hashes("") == ()


def test_tools_tool_calls_and_names_are_part_of_the_prompt() -> None:
    messages = [{"role": "user", "content": text_of(2)}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    reordered_tool = {"function": {"parameters": {"type": "object"}, "name": "get_weather"}, "type": "function"}
    with_tool = chat_hashes(chat(messages, tools=[tool]))
    assert with_tool != chat_hashes(chat(messages))
    assert with_tool == chat_hashes(chat(messages, tools=[reordered_tool]))  # key order does not matter
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    other_call = {**call, "function": {**call["function"], "arguments": '{"city": "Rome"}'}}
    after = [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": text_of(2, "u")}]
    assert chat_hashes(chat(messages + [{"role": "assistant", "tool_calls": [call]}] + after)) != chat_hashes(
        chat(messages + [{"role": "assistant", "tool_calls": [other_call]}] + after)
    )


def test_text_parts_of_a_content_list_hash_like_the_plain_string() -> None:
    text = text_of(3)
    as_string = chat_hashes(chat([{"role": "user", "content": text}]))
    as_parts = chat_hashes(chat([{"role": "user", "content": [{"type": "text", "text": text}]}]))
    assert as_string == as_parts


def test_different_images_give_different_hashes_after_them() -> None:
    def with_image(url: str) -> tuple[int, ...]:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text_of(3)}]
        return chat_hashes(chat([{"role": "user", "content": parts}]))

    assert with_image("http://x/cat.png") == with_image("http://x/cat.png")
    assert with_image("http://x/cat.png") != with_image("http://x/dog.png")


@pytest.mark.parametrize(
    "messages",
    [
        "not a list",
        [None, 3, "x"],
        [{"role": None, "content": 5}],
        [{"role": "user", "content": [None, 1, {"type": "text", "text": 7}, {"type": "image_url"}]}],
        [{"role": "user", "content": {"nested": "dict"}}],
        [{"role": "user", "content": "ok", "extra": 2**70}],  # orjson cannot serialize this int
    ],
)
def test_malformed_chat_fields_contribute_nothing_instead_of_raising(messages: Any) -> None:
    body = chat(messages, tools="not a list")
    info = build_request_info("chat", body, "interactive", CONFIG)
    assert info.model == "m"
    assert len(info.block_hashes) <= 1


def test_completion_prompt_shapes_hash_consistently() -> None:
    text = text_of(3)
    assert completion_hashes([text]) == completion_hashes(text)  # a batch of one is the bare prompt
    assert completion_hashes([text, "second"])[:3] == completion_hashes(text)
    ids = list(range(1000, 1000 + 16 * 3))
    assert len(completion_hashes(ids)) == 3  # 16 token ids fill one block
    assert completion_hashes([ids]) == completion_hashes(ids)
    assert completion_hashes(ids) == completion_hashes(list(ids))
    assert completion_hashes(ids) != completion_hashes(ids[:-1] + [7])
    assert completion_hashes(ids)[:2] == completion_hashes(ids[:-1] + [7])[:2]


@pytest.mark.parametrize("prompt", [[1.5, 2.5], [-1, 3], [2**40], [{"a": 1}], [[1, "x"]], 42, None, {}])
def test_invalid_prompts_contribute_nothing_instead_of_raising(prompt: Any) -> None:
    assert completion_hashes(prompt) == ()


def test_embedding_input_hashes_like_a_completion_prompt() -> None:
    for prompt in (text_of(2), [text_of(2), "b"], list(range(40)), [list(range(40))]):
        embedding = block_hashes("m", {"model": "m", "input": prompt}, "embedding", CONFIG)
        assert embedding == completion_hashes(prompt)
        assert embedding


def test_embedding_messages_hash_like_chat() -> None:
    body = chat([{"role": "user", "content": text_of(2)}])
    assert block_hashes("m", body, "embedding", CONFIG) == chat_hashes(body)


def test_block_cap_ignores_text_beyond_it() -> None:
    config = RoutingConfig(max_blocks=8)
    long_text = text_of(100)
    hashes = block_hashes("m", {"model": "m", "prompt": long_text}, "completion", config)
    assert len(hashes) == 8
    truncated = long_text[: 8 * BLOCK] + "completely different tail"
    assert block_hashes("m", {"model": "m", "prompt": truncated}, "completion", config) == hashes
    tokens = block_hashes("m", {"model": "m", "prompt": list(range(100_000))}, "completion", config)
    assert len(tokens) == 8


def test_block_cap_spans_many_small_messages() -> None:
    config = RoutingConfig(max_blocks=4)
    messages = [{"role": "user", "content": "short message"}] * 500
    info = build_request_info("chat", chat(messages), "batch", config)
    assert len(info.block_hashes) == 4
    assert info.prompt_chars > 500 * len("short message")


def test_build_request_info_fills_every_field() -> None:
    body = {"model": "llama", "prompt": text_of(2), "stream": True}
    info = build_request_info("completion", body, "batch", CONFIG, body_bytes=321)
    assert (info.model, info.priority_class, info.stream, info.body_bytes) == ("llama", "batch", True, 321)
    assert info.prompt_chars == 2 * BLOCK
    assert info.block_hashes == completion_hashes(text_of(2), model="llama")
    assert build_request_info("completion", {**body, "stream": "yes"}, "batch", CONFIG).stream is False


def test_a_chats_anchor_is_the_full_blocks_of_its_instructions_and_its_opening_ends_its_first_own_turn() -> None:
    system = {"role": "system", "content": text_of(10.5)}
    turns = [{"role": "user", "content": text_of(3, "u")}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": text_of(2, "v")}]
    first = build_request_info("chat", chat([system, turns[0]]), "interactive", CONFIG)
    later = build_request_info("chat", chat([system, *turns]), "interactive", CONFIG)
    assert first.anchor_blocks == later.anchor_blocks == 10  # "\x1esystem\x1f" + 10.5 blocks of text
    assert first.block_hashes[:10] == later.block_hashes[:10]
    alone = build_request_info("chat", chat([system]), "interactive", CONFIG)
    assert alone.anchor_blocks == 0  # nothing follows the first message: no conversation to anchor
    prompt = build_request_info("completion", {"model": "m", "prompt": text_of(12)}, "interactive", CONFIG)
    assert prompt.anchor_blocks == 0
    capped = build_request_info("chat", chat([{"role": "system", "content": text_of(300)}, turns[0]]), "batch",
                                CONFIG)
    assert capped.anchor_blocks == len(capped.block_hashes) == CONFIG.max_blocks  # never past what was hashed
    # Without instructions the first user turn is the conversation's own: no anchor, and every turn's opening
    # ends where the first turn's prompt does.
    alone_turn = build_request_info("chat", chat(turns[:1]), "interactive", CONFIG)
    untended = build_request_info("chat", chat(turns), "interactive", CONFIG)
    assert alone_turn.anchor_blocks == untended.anchor_blocks == 0
    assert alone_turn.opening_blocks == untended.opening_blocks == len(alone_turn.block_hashes) == 3
    developer = build_request_info("chat", chat([{**system, "role": "developer"}, *turns]), "interactive", CONFIG)
    assert developer.anchor_blocks == 10  # the developer role is the newer name of the system one
    tools = [{"type": "function", "function": {"name": "lookup", "description": text_of(4)}}]
    with_tools = build_request_info("chat", {**chat(turns), "tools": tools}, "interactive", CONFIG)
    tool_bytes = len(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS))
    assert with_tools.anchor_blocks == tool_bytes // BLOCK > 0  # tools are instructions a tenant's chats share


def test_unknown_kind_is_a_programming_error() -> None:
    assert "chat" in KINDS
    with pytest.raises(ValueError, match="unknown request kind"):
        list(prompt_parts("rerank", {"model": "m"}))


def test_chain_hashes_is_seeded_by_model_and_salt() -> None:
    data = b"x" * (2 * BLOCK)
    assert chain_hashes(data, prefix_seed("m"), BLOCK) != chain_hashes(data, prefix_seed("m", "salt"), BLOCK)
    assert prefix_seed("m", 123) == prefix_seed("m")  # a non-string salt is ignored


def test_a_200_kb_prompt_hashes_well_under_a_millisecond() -> None:
    body = chat([{"role": "system", "content": text_of(20)}, {"role": "user", "content": text_of(3200, "big")}])
    assert len(body["messages"][1]["content"]) >= 200_000
    timings = []
    for _ in range(20):
        started = time.perf_counter()
        info = build_request_info("chat", body, "interactive", CONFIG)
        timings.append(time.perf_counter() - started)
    assert len(info.block_hashes) == CONFIG.max_blocks
    assert min(timings) < 0.0005
