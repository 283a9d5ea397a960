"""The routing benchmark: its pure parts directly, and a --quick run end to end in a subprocess."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.loadtest.bench.client import PoissonChatDriver, RequestSample
from kvgate.loadtest.bench.inference_perf import SharedPrefixSpec, inference_perf_config, samples_from_report
from kvgate.loadtest.bench.processes import external_argv
from kvgate.loadtest.bench.report import DOCS_END, DOCS_START, BenchReport, ScenarioReport, update_docs
from kvgate.loadtest.bench.results import BASELINE_POLICY, EXTERNAL, KVGATE, ORACLE, RowPlan, RowRun, ScenarioRun
from kvgate.loadtest.bench.scenarios import ChatScenario, SharedPrefixScenario
from kvgate.loadtest.bench.sizing import fleet_options, oracle_options, sim_flags
from kvgate.loadtest.bench.summary import percentile, summarise_scenario
from kvgate.loadtest.bench.workload import QUICK_WORKLOAD, PrefixFootprint, WorkloadSpec, build_conversations
from kvgate.simulator import SimFleet, SimOptions, add_sim_arguments, sim_options_from_args

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXPECTED_ROWS = ["oracle", "round-robin", "cache-aware", "cache-aware x3"]


def test_conversations_are_deterministic_and_zipf_favours_the_first_tenant() -> None:
    spec = WorkloadSpec(tenants=8, conversations=400, skew="zipf")
    first, again = build_conversations(spec), build_conversations(spec)
    assert first == again
    counts = [sum(c.tenant == tenant for c in first) for tenant in range(spec.tenants)]
    assert counts[0] > 2 * counts[3] > 0
    prompts = {c.tenant: {d.system_prompt for d in first if d.tenant == c.tenant} for c in first}
    assert all(len(texts) == 1 for texts in prompts.values())  # one shared system prompt per tenant
    assert len({text for texts in prompts.values() for text in texts}) == len(prompts)
    uniform = [c.tenant for c in build_conversations(spec.with_skew("uniform"))]
    assert max(uniform.count(t) for t in range(8)) < 2 * min(uniform.count(t) for t in range(8))


def test_fleet_cache_holds_half_the_prefixes_in_play_and_the_oracle_all_prefixes() -> None:
    spec = WorkloadSpec()
    footprint = PrefixFootprint.of(spec, 16)
    sized = ChatScenario("chat-uniform", spec).footprint(16)
    fleet = fleet_options(sized, spec.model, SimOptions(), cache_fraction=0.5)
    oracle = oracle_options(sized, spec.model, SimOptions())
    in_play = footprint.all_system_prompts(spec) + spec.concurrency * footprint.history_blocks
    assert fleet.num_gpu_blocks == -(-in_play // 2)
    assert oracle.num_gpu_blocks >= footprint.whole_workload(spec)
    assert oracle.max_num_seqs >= spec.concurrency
    assert fleet.max_model_len >= footprint.longest_request_tokens
    # The shapes: 24 tenants of ~1,600-token system prompts, 240 six-turn chats at 20 req/s.
    assert (spec.tenants, spec.system_prompt_chars // 4, spec.conversations, spec.turns, spec.rate) == \
        (24, 1600, 240, 6, 20.0)


def test_shared_prefix_fleet_holds_half_the_groups_and_inference_perf_gets_its_shape(tmp_path: Path) -> None:
    spec = SharedPrefixSpec()
    scenario = SharedPrefixScenario("shared-prefix", spec, "inference-perf", "/tok/model")
    sized = scenario.footprint(16)
    fleet = fleet_options(sized, spec.model, SimOptions(), cache_fraction=0.5)
    assert fleet.num_gpu_blocks * 2 >= spec.groups * spec.system_prompt_tokens // 16
    assert fleet.num_gpu_blocks * 3 < spec.groups * spec.system_prompt_tokens * 1.5 // 16 * 2  # not all of them
    config = inference_perf_config(spec, "http://127.0.0.1:1", "/tok/model", tmp_path)
    assert config["data"]["shared_prefix"] | {} == {"num_groups": 64, "num_prompts_per_group": 10,
                                                    "system_prompt_len": 450, "question_len": 50,
                                                    "output_len": 32, "seed": 0}
    assert config["load"]["stages"] == [{"rate": 10.0, "duration": 40}] and config["load"]["type"] == "poisson"
    assert config["api"] == {"type": "completion", "streaming": True}


def test_inference_perf_per_request_report_becomes_samples() -> None:
    records = [
        {"start_time": 100.0, "end_time": 100.5, "error": None,
         "info": {"response_metrics": {"chunk_times": [100.1, 100.2, 100.4]}}},
        {"start_time": 101.0, "end_time": 101.2, "error": {"error_type": "timeout"}, "info": {}},
    ]
    ok, failed = samples_from_report(records)
    assert (ok.start, ok.ttft, ok.e2e, ok.output_chunks, ok.error) == (0.0, pytest.approx(0.1), 0.5, 3, None)
    assert failed.ttft is None and "timeout" in failed.error and failed.start == 1.0


def test_sim_flags_rebuild_the_same_options() -> None:
    footprint = ChatScenario("chat-uniform", QUICK_WORKLOAD).footprint(16)
    options = fleet_options(footprint, QUICK_WORKLOAD.model, SimOptions(speed=2.0), cache_fraction=0.25)
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    assert sim_options_from_args(parser.parse_args(sim_flags(options))) == options


def test_external_template_gets_space_separated_workers_and_port() -> None:
    argv = external_argv("router --worker-urls {workers} --port {port} --policy cache_aware",
                         ["http://127.0.0.1:1", "http://127.0.0.1:2"], 9000)
    assert argv == ["router", "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--port", "9000",
                    "--policy", "cache_aware"]


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(v) for v in range(101)], 99) == 99.0


def _row(name: str, kind: str, policy: str | None, hits: int, per_replica: list[int], ttft: float) -> RowRun:
    stats = [{"requests": n, "prefix_cache_queries": 1000, "prefix_cache_hits": hits, "generation_tokens": n,
              "preemptions": 0, "evictions": 0} for n in per_replica]
    samples = [RequestSample(start=0.0, ttft=ttft, e2e=2 * ttft, output_chunks=4, error=None)] * sum(per_replica)
    return RowRun(RowPlan(name, kind, policy), samples=samples, replica_stats=stats, wall_seconds=10.0)


def _scenario(skewed: bool, rows: list[RowRun]) -> ScenarioRun:
    return ScenarioRun("chat-zipf" if skewed else "chat-uniform", "", {}, skewed, SimOptions(), SimOptions(), rows)


def test_targets_under_zipf_compare_balance_latency_and_hits_with_round_robin_and_the_peer() -> None:
    scenario = _scenario(True, [
        _row(ORACLE, ORACLE, None, 900, [30], 0.5),
        _row(BASELINE_POLICY, KVGATE, BASELINE_POLICY, 400, [10, 10, 10], 0.3),
        _row("cache-aware", KVGATE, "cache-aware", 880, [11, 10, 9], 0.2),
        _row("least-load", KVGATE, "least-load", 500, [16, 7, 7], 0.4),
        _row("sglang", EXTERNAL, None, 850, [14, 8, 8], 0.2),
    ])
    rows = {row.name: row for row in summarise_scenario(scenario, peer="sglang")}
    assert rows["round-robin"].targets == [] and rows[ORACLE].targets == [] and rows["sglang"].targets == []
    assert rows["cache-aware"].hit_rate == 0.88
    assert all(check.passed for check in rows["cache-aware"].targets), rows["cache-aware"].targets
    failed = {check.name for check in rows["least-load"].targets if not check.passed}
    assert failed == {"hit >= round-robin + 25 pts", "max/mean requests <= 1.25", "TTFT p99 <= round-robin's",
                      "E2E p99 <= round-robin's + 5 %", "hit >= sglang's"}


def test_targets_without_skew_compare_hits_and_ttft_with_the_peer_and_the_oracle() -> None:
    scenario = _scenario(False, [
        _row(ORACLE, ORACLE, None, 900, [30], 0.5),
        _row(BASELINE_POLICY, KVGATE, BASELINE_POLICY, 400, [10, 10, 10], 0.3),
        _row("cache-aware", KVGATE, "cache-aware", 800, [11, 10, 9], 0.25),
        _row("sglang", EXTERNAL, None, 850, [14, 8, 8], 0.2),
    ])
    rows = {row.name: row for row in summarise_scenario(scenario, peer="sglang")}
    assert {check.name: check.passed for check in rows["cache-aware"].targets} == {
        "hit >= sglang's": False, "TTFT p99 <= sglang's": False, "TTFT p99 <= round-robin's": True,
        "hit >= 95% of oracle": False}
    alone = {row.name: row for row in summarise_scenario(_scenario(False, scenario.rows[:3]), peer="sglang")}
    assert [check.detail for check in alone["cache-aware"].targets[:2]] == ["not measured"] * 2


def test_docs_section_is_replaced_between_markers_and_the_rest_kept(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nIntro.\n\n{DOCS_START}\nold table\n{DOCS_END}\n\n## Other section\n")
    report = BenchReport(
        command="python -m kvgate.loadtest.bench", date="2026-01-01 00:00 UTC",
        machine={"nproc": 2, "platform": "linux", "python": "3.11"},
        fleet={"replicas": 3, "cache_fraction": 0.25, "speed": 1.0},
        scenarios=[ScenarioReport("chat-uniform", "Chats.", dataclasses.asdict(WorkloadSpec()),
                                  {"num_gpu_blocks": 600, "block_size": 16, "max_num_seqs": 64},
                                  {"num_gpu_blocks": 9000, "max_num_seqs": 48}, [], {})],
        load_average="0.50 / 1.00",
    )
    update_docs(docs, report)
    update_docs(docs, report)
    text = docs.read_text()
    assert "old table" not in text and text.count(DOCS_START) == 1
    assert text.startswith("# Benchmarks\n\nIntro.") and text.rstrip().endswith("## Other section")
    assert "Machine: 2 CPUs" in text and "`python -m kvgate.loadtest.bench`" in text


def test_quick_bench_writes_a_report_where_cache_aware_beats_round_robin(tmp_path: Path) -> None:
    out = tmp_path / "bench-out"
    docs = tmp_path / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "kvgate.loadtest.bench", "--quick", "--scenarios", "chat-zipf", "--out", str(out),
         "--docs", str(docs)],
        cwd=REPO, capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "chat-zipf/cache-aware:" in result.stderr  # one progress line per row

    report = json.loads((out / "report.json").read_text())
    (scenario,) = report["scenarios"]
    rows = {row["name"]: row for row in scenario["rows"]}
    assert list(rows) == EXPECTED_ROWS
    for row in rows.values():
        assert row["failure"] is None
        assert row["errors"] == 0 and row["requests"] > 0
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert 0 < row["ttft_p50"] <= row["ttft_p99"]
        assert abs(sum(row["replica_shares"]) - 1.0) < 1e-9
    assert rows["cache-aware"]["hit_rate"] > rows["round-robin"]["hit_rate"]
    for name in ("round-robin", "cache-aware", "cache-aware x3"):  # every request routed once, counted by reason
        assert sum(rows[name]["decisions"].values()) == rows[name]["requests"]
    assert rows["round-robin"]["decisions"].keys() == {"round_robin"} and rows["oracle"]["decisions"] == {}
    assert rows["oracle"]["hit_rate"] >= rows["round-robin"]["hit_rate"]
    assert {check["name"] for check in rows["cache-aware"]["targets"]} >= {"hit >= round-robin + 25 pts",
                                                                           "max/mean requests <= 1.25"}
    for plot in scenario["plots"].values():
        assert (out / plot).read_bytes().startswith(PNG_MAGIC)
    assert "| cache-aware |" in (out / "report.md").read_text()
    assert DOCS_START in docs.read_text() and "| cache-aware x3 |" in docs.read_text()


async def test_poisson_driver_sends_every_turn_paced_by_its_arrival_rate() -> None:
    spec = dataclasses.replace(QUICK_WORKLOAD, conversations=12, turns=3, concurrency=4, rate=40.0, duration=20.0)
    fleet = await SimFleet.start([0], SimOptions(speed=20.0, max_model_len=4096, models=(spec.model,)))
    try:
        conversations = build_conversations(spec)
        driver = PoissonChatDriver(spec, fleet.urls)
        samples = await driver.run(conversations)
    finally:
        await fleet.stop()
    assert len(samples) == spec.conversations * spec.turns and all(s.error is None for s in samples)
    assert all(s.ttft is not None and s.ttft <= s.e2e for s in samples)
    starts = sorted(s.start for s in samples)
    assert starts[-1] >= 0.5 * len(samples) / spec.rate  # paced by the arrival process, not sent at once
