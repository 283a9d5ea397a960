"""Precise-routing settings come from flags (repeatable), the environment and the config file, and are checked."""

from __future__ import annotations

import pytest

from kvgate.router.cli import build_parser, cli_settings, main
from kvgate.router.config import ConfigError, build_config, from_sources
from kvgate.router.gateway import Gateway, default_discovery

BASE = {"endpoints": "http://127.0.0.1:1"}


def parse(*argv: str):
    return from_sources(cli_settings(build_parser().parse_args(["serve", *argv])), environ={})


def test_flags_repeat_for_explicit_endpoints_and_tokenizers(tiny_model_dir):
    config = parse("--endpoints", "http://127.0.0.1:1,http://127.0.0.1:2",
                   "--kv-events-endpoint", "http://127.0.0.1:1=tcp://127.0.0.1:7001",
                   "--kv-events-endpoint", "http://127.0.0.1:2=tcp://127.0.0.1:7002",
                   "--tokenizer", f"m1={tiny_model_dir}", "--tokenizer", f"m2={tiny_model_dir}",
                   "--kv-events-hold", "0.5")
    assert config.kv_events_endpoint == ("http://127.0.0.1:1=tcp://127.0.0.1:7001",
                                         "http://127.0.0.1:2=tcp://127.0.0.1:7002")
    assert len(config.tokenizer) == 2 and config.kv_events_hold == 0.5


def test_environment_and_file_set_the_same_settings(tmp_path, tiny_model_dir):
    path = tmp_path / "config.yaml"
    path.write_text(f"endpoints: [http://127.0.0.1:1]\nkv_events_endpoint: tcp://{{host}}:5557\n"
                    f"tokenizer: [m={tiny_model_dir}]\n")
    config = from_sources({"config": str(path)}, {"KVGATE_KV_EVENTS_REPLAY_ENDPOINT": "tcp://{host}:5558",
                                                  "KVGATE_KV_EVENTS_TOPIC": "events"})
    assert config.kv_events_endpoint == ("tcp://{host}:5557",)
    assert (config.kv_events_replay_endpoint, config.kv_events_topic) == (("tcp://{host}:5558",), "events")


@pytest.mark.parametrize(("settings", "message"), [
    ({"kv_events_endpoint": ["http://x:1"], "tokenizer": ["m=/d"]}, "not tcp://HOST:PORT"),
    ({"kv_events_endpoint": ["tcp://{host}:1", "tcp://{host}:2"], "tokenizer": ["m=/d"]}, "one template"),
    ({"kv_events_endpoint": ["tcp://{host}:5557"]}, "needs --tokenizer"),
    ({"tokenizer": ["no-directory"]}, "MODEL=DIR"),
    ({"kv_events_hold": -1}, "kv_events_hold"),
])
def test_bad_values_name_the_setting(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_config(BASE, settings)


def test_a_tokenizer_directory_without_tokenizer_json_stops_the_gateway(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvgate.router.cli.configure_logging", lambda level: None)  # keep pytest's log capture
    config = build_config(BASE, {"tokenizer": [f"m={tmp_path}"], "kv_events_endpoint": ["tcp://{host}:5557"]})
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Gateway(config, default_discovery(config))
    assert main(["serve", "--endpoints", "http://127.0.0.1:1", "--tokenizer", f"m={tmp_path}",
                 "--kv-events-endpoint", "tcp://{host}:5557", "--listen", "127.0.0.1:0"]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_sim_with_kv_events_but_no_tokenizer_stops_with_a_message(capsys):
    assert main(["sim", "--ports", "0", "--kv-events"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err
