"""One setting given in the file, the environment and on the command line: flags win, then env, then the file."""

from __future__ import annotations

from kvgate.router.cli import build_parser, cli_settings
from kvgate.router.config import from_sources


def test_flags_override_env_which_overrides_the_file(tmp_path):
    config_file = tmp_path / "kvgate.yaml"
    config_file.write_text("endpoints: http://127.0.0.1:1\npolicy: round-robin\nretries: 3\nscrape_interval: 0.5\n"
                           "routing:\n  load_bound: 1.5\n  load_slack: 4\n")
    env = {"KVGATE_CONFIG": str(config_file), "KVGATE_RETRIES": "2", "KVGATE_SCRAPE_INTERVAL": "0.3",
           "KVGATE_ROUTING_LOAD_SLACK": "3"}
    flags = build_parser().parse_args(["serve", "--retries", "1", "--routing-load-slack", "5"])
    config = from_sources(cli_settings(flags), env)
    assert config.retries == 1  # file 3 < env 2 < flag 1
    assert config.scrape_interval == 0.3  # file 0.5 < env 0.3
    assert config.policy == "round-robin"  # the file alone
    assert config.routing.load_slack == 5 and config.routing.load_bound == 1.5  # nested: flag > env > file, per key
