"""The soak benchmark end to end at a tiny size: real kvgate and simulator processes, faults, samples, report."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvgate.loadtest.kit.report import markers
from kvgate.loadtest.soak.load import MALFORMED_REQUESTS
from tests.bench_run import run_bench

OTHER_SECTION = "<!-- bench:other:start -->\nkept as it was\n<!-- bench:other:end -->\n"


@pytest.fixture(scope="module")
def soak_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    out = tmp_path_factory.mktemp("soak")
    docs = out / "benchmarks.md"
    docs.write_text(OTHER_SECTION)
    done = run_bench("soak", "--quick", "--duration", "15", "--concurrency", "10", "--out", str(out), "--docs", str(docs),
                     timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return orjson.loads((out / "soak.json").read_bytes()), out, docs


@pytest.mark.timeout(120)
def test_quick_soak_loses_no_request_through_a_replica_kill(soak_run) -> None:
    report, _, _ = soak_run
    assert report["lost"] == 0, report["by_kind"]
    streams = report["by_kind"]["stream"]
    assert streams["outcomes"]["ok"] >= streams["started"] // 2
    # Only answers kvgate chose: complete streams, or an error event where the killed replica cut one off.
    assert set(streams["outcomes"]) <= {"ok", "error_event", "http_502", "http_503"}
    assert [event["event"] for event in report["events"]][:2] == ["kill", "restart"]
    for name in MALFORMED_REQUESTS:
        kind = report["by_kind"][f"malformed:{name}"]
        assert kind["outcomes"] == {"rejected_4xx": kind["started"]}
    assert report["by_kind"]["abort_mid_stream"]["outcomes"].get("aborted", 0) >= 1
    assert report["by_kind"]["slow_reader"]["started"] >= 1
    assert report["gateway"]["requests_in_flight"] == {"total": 0.0}
    assert report["tracebacks"] == 0


@pytest.mark.timeout(120)
def test_quick_soak_samples_kvgate_and_writes_its_report(soak_run) -> None:
    report, out, docs = soak_run
    samples = report["samples"]
    assert len(samples) >= 10
    assert all(sample["rss_mb"] > 10 and sample["fds"] > 0 for sample in samples)
    assert samples[-1]["t"] > report["load_end_s"]  # sampling went on while descriptors settled
    memory = report["memory"]
    assert memory["min_mb"] <= memory["at_warmup_end_mb"] <= memory["max_mb"]
    assert isinstance(memory["flat"], bool)
    assert (out / "soak.png").read_bytes().startswith(b"\x89PNG")
    text = docs.read_text()
    start, end = markers("soak")
    assert OTHER_SECTION in text
    section = text[text.index(start):text.index(end)]
    assert "| RSS (MiB) |" in section and "| stream |" in section and "Memory is" in section
