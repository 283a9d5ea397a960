"""The benchmark kit: `kvgate bench` lists every scenario, docs sections are spliced in place, children are stopped,
and the micro-benchmark scenarios run end to end."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.loadtest.cli import SCENARIOS, main, scenario_parser
from kvgate.loadtest.kit.processes import ProcessError, ports_to_bind_later, start_gateway, start_stub, stopping
from kvgate.loadtest.kit.report import write_docs_section
from tests.bench_run import run_bench


def test_bench_help_lists_every_scenario_with_a_line_on_what_it_measures() -> None:
    done = run_bench("--help", timeout=30)
    assert done.returncode == 0, done.stderr
    for scenario in SCENARIOS:
        line = next(line for line in done.stdout.splitlines() if line.strip().startswith(scenario.name + " "))
        assert len(line.split(None, 1)[1]) > 20, line
    assert {s.name for s in SCENARIOS} >= {"routing", "chats", "inference-perf", "real-engines", "overhead",
                                           "priority", "burst", "soak", "rolling", "picker", "hashing", "scrape-parse"}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_scenario_takes_the_common_options_it_declares(scenario) -> None:
    options = scenario_parser(scenario).parse_args(["--quick", "--out", "x", "--docs", "d.md"])
    assert options.quick and options.out == Path("x") and options.docs == Path("d.md")
    assert all(hasattr(options, name) for name in scenario.common)


def test_an_unknown_scenario_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-scenario"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_docs_section_is_replaced_in_place_and_other_sections_are_kept(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("intro\n<!-- bench:priority:start -->\nold\n<!-- bench:priority:end -->\noutro\n")
    write_docs_section(docs, "priority", "new\n")
    write_docs_section(docs, "priority", "newer\n")
    assert docs.read_text() == "intro\n<!-- bench:priority:start -->\nnewer\n<!-- bench:priority:end -->\noutro\n"
    fresh = tmp_path / "missing" / "benchmarks.md"
    write_docs_section(fresh, "priority", "first\n")
    assert fresh.read_text() == "<!-- bench:priority:start -->\nfirst\n<!-- bench:priority:end -->\n"


async def test_children_are_stopped_when_their_block_exits_and_a_failed_start_leaves_none(tmp_path: Path) -> None:
    stub, urls = await start_stub("stub", 2, tmp_path)
    async with stopping(stub):
        gateway, _ = await start_gateway("kvgate", urls, ["--policy", "round-robin"], tmp_path)
        async with stopping(gateway):
            pids = [stub.pid, gateway.pid]
            assert all(pids) and stub.cpu_seconds() > 0
    assert stub.pid is None and gateway.pid is None
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    with pytest.raises(ProcessError, match="exited before it was ready"):
        await start_gateway("broken", urls, ["--policy", "no-such-policy"], tmp_path)


def test_ports_to_bind_later_are_free_distinct_and_never_a_connections_source_port() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = ports_to_bind_later(4)
    assert len(set(ports)) == 4 and all(port < low for port in ports)
    for port in ports:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))


def test_hashing_and_scrape_parse_write_their_tables(tmp_path: Path) -> None:
    for scenario in ("hashing", "scrape-parse"):
        done = run_bench(scenario, "--quick", "--out", str(tmp_path), "--docs", str(tmp_path / "docs.md"))
        assert done.returncode == 0, done.stderr[-2000:]
    hashing = json.loads((tmp_path / "hashing.json").read_text())
    (row,) = hashing["rows"]
    assert row[0].startswith("4 KB chat") and all(value > 0 for value in row[1:3]) and row[4] > 0  # parse, hash, blocks
    parse = json.loads((tmp_path / "scrape-parse.json").read_text())
    assert parse["speed_up"] > 1 and parse["page_kib"] > 100
    docs = (tmp_path / "docs.md").read_text()
    assert "<!-- bench:hashing:start -->" in docs and "| prometheus_client full parse |" in docs


def test_inference_perf_skips_with_a_message_when_it_is_not_installed(tmp_path: Path) -> None:
    done = run_bench("inference-perf", "--quick", "--inference-perf", "no-such-inference-perf",
                   "--out", str(tmp_path), timeout=30)
    assert done.returncode == 0 and "skipped" in done.stderr and "not installed" in done.stderr
    assert not (tmp_path / "inference-perf.json").exists()


def test_real_engines_without_vllm_says_what_is_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KVGATE_VLLM_PYTHON", raising=False)
    done = run_bench("real-engines", "--quick", "--out", str(tmp_path), timeout=30)
    assert done.returncode == 2 and "KVGATE_VLLM_PYTHON" in done.stderr


def test_without_the_kit_kvgate_bench_says_so_and_serving_is_unaffected() -> None:
    code = ("import importlib.abc, sys\n"
            "class NoKit(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.startswith('kvgate.loadtest'):\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, NoKit())\n"
            "from kvgate.router.cli import build_parser, main\n"
            "build_parser().parse_args(['serve', '--endpoints', 'http://127.0.0.1:1'])\n"
            "sys.exit(main(['bench', 'routing']))\n")  # as in the image, which leaves kvgate/loadtest out
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "needs the benchmark kit" in done.stderr, done.stderr
