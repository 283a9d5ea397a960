"""The offline model directory the real-engine suite serves: deterministic, and a tokenizer that fits its config."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from kvgate.loadtest.kit.tiny_model import BOS, write_tiny_model


def test_tiny_model_is_byte_identical_from_run_to_run(tmp_path):
    first, second = write_tiny_model(tmp_path / "a"), write_tiny_model(tmp_path / "b")
    names = sorted(path.name for path in first.iterdir())
    assert names == ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json"]
    assert all((first / name).read_bytes() == (second / name).read_bytes() for name in names)


def test_tiny_model_tokenizer_matches_its_config(tmp_path):
    directory = write_tiny_model(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.token_to_id(BOS) == config["bos_token_id"]
    text = "The gateway routes each request to the replica that caches its prefix."
    encoded = tokenizer.encode(text)
    assert encoded.ids[0] == config["bos_token_id"]
    assert 2 < len(text) / (len(encoded.ids) - 1) < 6  # characters per token, as real tokenizers give on prose
    assert tokenizer.decode(encoded.ids) == text
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())
