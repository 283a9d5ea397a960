"""Requests are tokenized as vLLM tokenizes them: the chat template rendered as transformers renders it."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvgate.engine.tokenizer import EngineTokenizer, TokenizerError
from kvgate.loadtest.kit.tiny_model import BOS
from kvgate.policies import RoutingConfig
from kvgate.router.requests import parse_request
from kvgate.router.tokenizing import RequestTokenizer

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> EngineTokenizer:
    return EngineTokenizer.load(tiny_model_dir)


def test_chat_renders_the_template_with_bos_and_a_generation_prompt(tokenizer):
    text = tokenizer.render_chat({"messages": MESSAGES})
    assert text == (f"{BOS}<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nSay hello<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tokenizer.render_chat({"messages": MESSAGES, "add_generation_prompt": False}).endswith("<|eot_id|>")


def test_chat_ids_carry_one_bos_from_the_template_and_special_tokens_as_single_ids(tokenizer):
    ids = tokenizer.chat_ids({"messages": MESSAGES})
    bos = tokenizer.encode(BOS, add_special_tokens=False)
    assert len(bos) == 1 and ids[0] == bos[0] and ids.count(bos[0]) == 1


def test_text_parts_render_like_a_string_content(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]}]
    assert "Say hello" in tokenizer.render_chat({"messages": parts})


def test_tools_are_rendered_with_every_function_field(tokenizer):
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    text = tokenizer.render_chat({"messages": MESSAGES, "tools": tools})
    rendered = json.loads(text.split("Tools: ", 1)[1].split("<|eot_id|>", 1)[0])
    assert rendered == [{"type": "function", "function": {"name": "now", "description": None,
                                                          "parameters": {"type": "object"}}}]


def test_the_instructions_length_is_the_ids_the_system_prompt_renders_to_alone(tokenizer):
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]}
    ids = tokenizer.chat_ids(body)
    alone = tokenizer.chat_ids({"messages": MESSAGES[:1], "add_generation_prompt": False})
    assert tokenizer.leading_messages_length(body, 1, ids) == len(alone) and ids[:len(alone)] == alone
    assert alone[-1] == tokenizer.encode("<|eot_id|>", add_special_tokens=False)[0]  # the system turn ends there
    other = {"messages": [MESSAGES[0], {"role": "user", "content": "Another conversation"}]}
    assert tokenizer.leading_messages_length(other, 1, tokenizer.chat_ids(other)) == len(alone)  # remembered
    assert tokenizer.leading_messages_length(body, 2, ids) > len(alone)  # the first user turn too


async def test_the_tokenizing_stage_counts_the_anchor_inline_and_on_a_worker_thread(tokenizer, tiny_model_dir):
    body = {"model": "m", "messages": [{"role": "system", "content": "You answer for tenant one. " * 30},
                                       {"role": "user", "content": "My own question"}]}
    alone = tokenizer.chat_ids({"messages": body["messages"][:1], "add_generation_prompt": False})
    for offload_bytes in (1 << 30, 0):  # inline; every body on a worker thread
        stage = RequestTokenizer.load({"m": str(tiny_model_dir)}, offload_bytes)
        request = parse_request("/v1/chat/completions", json.dumps(body).encode(), "interactive", 0, RoutingConfig())
        info = (await stage.tokenize(request)).info
        assert info.token_ids == tuple(tokenizer.chat_ids(body)) and info.anchor_tokens == len(alone)
    no_system = {"model": "m", "messages": body["messages"][1:]}
    request = parse_request("/v1/chat/completions", json.dumps(no_system).encode(), "interactive", 0, RoutingConfig())
    assert (await stage.tokenize(request)).info.anchor_tokens == 0


def test_completion_prompts_get_the_tokenizers_bos_and_token_ids_pass_through(tokenizer):
    ids = tokenizer.completion_ids({"prompt": "def main():"})
    assert ids[0] == tokenizer.encode(BOS, add_special_tokens=False)[0]
    assert ids[1:] == tokenizer.encode("def main():", add_special_tokens=False)
    assert tokenizer.completion_ids({"prompt": ["def main():", "other"]}) == ids
    assert tokenizer.completion_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tokenizer.completion_ids({"prompt": [[5, 6], [7]]}) == [5, 6]
    assert tokenizer.completion_ids({"prompt": "x", "add_special_tokens": False}) == tokenizer.encode("x", False)


def test_a_template_error_is_a_tokenizer_error(tiny_model_dir, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"}))
    refusing = EngineTokenizer.load(tmp_path)
    with pytest.raises(TokenizerError, match="user first"):
        refusing.chat_ids({"messages": MESSAGES})
    assert refusing.leading_messages_length({"messages": MESSAGES}, 1, [1, 2, 3]) == 0  # cannot render them alone


def test_a_directory_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(TokenizerError):
        EngineTokenizer.load(tmp_path)


SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=40), st.sampled_from(SPECIALS + ["<|eot", "|>", " <|eot_id|> "])),
                max_size=12), st.booleans())
def test_piecewise_encoding_equals_the_librarys_whole_text_encoding(tokenizer, tiny_model_dir, pieces,
                                                                   add_special_tokens):
    text = "".join(pieces)
    whole = _library(tiny_model_dir).encode(text, add_special_tokens=add_special_tokens).ids
    assert tokenizer.encode(text, add_special_tokens) == whole
    assert tokenizer.encode(text, add_special_tokens) == whole  # again, from the remembered pieces


@functools.cache
def _library(directory) -> Tokenizer:
    return Tokenizer.from_file(str(directory / "tokenizer.json"))
