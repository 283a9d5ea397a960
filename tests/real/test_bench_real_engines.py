"""`kvgate bench real-engines --precise` end to end at a tiny size: engines publishing KV events, every row measured.

It runs before the suite's shared engines start (file order), so the two cores are its own.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.bench_run import run_bench

ROWS = ["oracle", "pressure oracle", "round-robin", "cache-aware", "cache-aware x2", "cache-aware x2 shared",
        "cache-aware precise", "cache-aware precise x2", "cache-aware precise x2 shared"]


@pytest.mark.timeout(600)
def test_every_real_engine_row_runs_and_precise_routing_finds_the_prefixes() -> None:
    # A short folder: the engines' IPC socket paths under it must fit in 107 characters.
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as out:
        # --duration: the quick preset's 10 s cap ended a row after 69 of its 72 requests once on CI's two cores;
        # this test asks that every row runs whole, so the cap must not bind.
        done = run_bench("real-engines", "--quick", "--precise", "--replicas", "2", "--skew", "zipf", "--policies",
                         "cache-aware", "--gateways", "2", "--duration", "40", "--out", out, timeout=420)
        assert done.returncode == 0, done.stderr[-3000:]
        (scenario,) = json.loads((Path(out) / "routing-real-engines.json").read_text())["scenarios"]
    rows = {row["name"]: row for row in scenario["rows"]}
    assert list(rows) == ROWS
    for row in rows.values():
        assert row["failure"] is None and row["errors"] == 0 and row["requests"] == 72, row
        assert 0.0 < row["hit_rate"] <= 1.0  # vLLM's own counters, read through /metrics
    for name in ("cache-aware precise", "cache-aware precise x2"):  # two gateways read the same engines' events
        precise = rows[name]
        # Routed on the events: most requests found their prefix held. (Not "hits more than round-robin": on 72
        # requests under zipf skew that is noise, and CI saw 59.8 % against 65.4 %; the full benchmark's rows in
        # docs/benchmarks.md make that comparison.)
        assert precise["decisions"].get("prefix_hit", 0) > precise["decisions"].get("cold", 0), precise


@pytest.mark.timeout(600)
def test_the_priority_benchmark_runs_on_real_engines_with_kvgate_unconfigured() -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as out:
        done = run_bench("priority", "--fleet", "real", "--quick", "--rows", "h", "--out", out, timeout=420)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((Path(out) / "priority-real.json").read_text())
    assert report["plan"]["real"] and report["capacity"]["measured_rps"] > 0
    (row,) = report["runs"]
    assert row["key"] == "h"
    for stats in (report["unloaded"]["interactive"], row["interactive"], row["batch"]):
        assert stats["sent"] > 0 and stats["lost"] == 0, (stats["first_problem"], stats)  # every request answered
        # At twice their capacity these engines' API servers sometimes close a connection before answering (FIFO
        # rows show it too); kvgate retries once elsewhere, then answers 503. Nothing else may fail.
        assert stats["errors"] <= stats["sent"] // 20, stats
        assert not stats["errors"] or stats["first_problem"].startswith("HTTP 503"), stats
    assert row["interactive"]["ttft_p99_ms"] > 0  # streamed through kvgate from the engines
