"""The overhead benchmark: a quick run end to end, and its profile summary, docs splicing and wrk adaptor."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvgate.loadtest.kit.processes import start_stub, stopping
from kvgate.loadtest.kit.report import markers
from kvgate.loadtest.overhead.client import LoadSpec
from kvgate.loadtest.overhead.rig import OUTSIDE_KVGATE, run_wrk, summarize, wrk_available
from tests.bench_run import run_bench

START_MARKER, END_MARKER = markers("overhead")
ROW_NAMES = [
    "4 KB chat, non-streaming, 32 concurrent",
    "4 KB chat, non-streaming, 128 concurrent",
    "4 KB chat, streamed (16 chunks), 32 concurrent",
    "4 KB chat, streamed (16 chunks), 128 concurrent",
    "4 KB chat, open loop 500 req/s",
    "4 KB chat, one at a time",
    "200 KB chat, one at a time",
]


def test_quick_run_reports_every_row_with_plausible_numbers(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- bench:other:start -->\nkept\n<!-- bench:other:end -->\n")
    out = tmp_path / "out"
    done = run_bench("overhead", "--quick", "--client", "python", "--no-profile", "--out", str(out), "--docs", str(docs),
                     timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]

    report = json.loads((out / "overhead.json").read_text())
    assert [row["name"] for row in report["rows"]] == ROW_NAMES
    for row in report["rows"]:
        direct, kvgate = row["direct"], row["kvgate"]
        assert direct["errors"] == kvgate["errors"] == 0, row
        for run in (direct, kvgate):
            assert run["requests"] > 0 and run["rps"] > 0, row
            assert 0 < run["p50_ms"] <= run["p99_ms"], row
        # A proxy hop cannot make the same stub answer several times faster.
        assert kvgate["rps"] < 3 * direct["rps"] and kvgate["p50_ms"] > direct["p50_ms"] / 3, row
    cpu = report["stream_cpu"]
    assert cpu["errors"] == 0 and cpu["chunks"] > 0 and cpu["kvgate_cpu_s"] > 0 and cpu["stub_cpu_s"] > 0

    text = docs.read_text()
    assert "kept" in text and text.count(START_MARKER) == 1 and text.count(END_MARKER) == 1
    assert "| 200 KB chat, one at a time |" in text and "What limits the result" in text
    assert (out / "overhead.md").read_text() in text


def test_profile_charges_each_sample_to_its_deepest_kvgate_function() -> None:
    raw = "\n".join([
        "main (kvgate/router/cli.py);Forwarder._open (kvgate/router/proxy.py);ClientSession._request (aiohttp/client.py) 6",
        "main (kvgate/router/cli.py);Handlers.inference (kvgate/router/handlers.py);parse_request (kvgate/router/requests.py) 3",
        "main (kvgate/router/cli.py);Runner.run (asyncio/runners.py) 1",
    ])
    profile = summarize(raw)
    assert profile.samples == 10
    assert profile.top_self[0] == ("ClientSession._request (aiohttp/client.py)", 0.6)
    assert profile.top_kvgate == [("Forwarder._open (kvgate/router/proxy.py)", 0.6),
                                  ("parse_request (kvgate/router/requests.py)", 0.3), (OUTSIDE_KVGATE, 0.1)]


@pytest.mark.skipif(not wrk_available(), reason="wrk is not installed")
async def test_wrk_adaptor_reads_wrk_summary_from_a_stub(tmp_path: Path) -> None:
    stub, (url,) = await start_stub("stub", 1, tmp_path)
    async with stopping(stub):
        result = await asyncio.to_thread(run_wrk, LoadSpec(url=url, stream=True, concurrency=4, duration_s=1))
    assert result.errors == 0 and result.requests > 10 and 0 < result.p50_ms <= result.p99_ms
