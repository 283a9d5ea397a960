"""kvgate/loadtest/locustfile.py run headless by locust against kvgate in front of simulated replicas."""

from __future__ import annotations

import asyncio
import csv
import os
import sys
from pathlib import Path

import pytest

from kvgate.simulator import SimFleet, SimOptions
from tests.harness import running_gateway

REPO = Path(__file__).resolve().parent.parent
LOCUST = Path(sys.executable).with_name("locust")
# Fast replicas: 4x time compression, short replies, so a few seconds hold dozens of conversations. They serve a
# model the locustfile is not told about: it asks the host's /v1/models.
FAST_SIM = SimOptions(speed=4.0, models=("acme/support-model",))
LOCUST_ENV = {
    "KVGATE_LT_TENANTS": "3",
    "KVGATE_LT_SYSTEM_PROMPT_CHARS": "2000",
    "KVGATE_LT_TURNS": "3",
    "KVGATE_LT_MAX_TOKENS": "16",
    "KVGATE_LT_THINK_TIME": "0.05-0.2",
    "KVGATE_LT_BATCH_SHARE": "0.25",
    "KVGATE_LT_BATCH_PROMPT_CHARS": "3000",
    "KVGATE_LT_BATCH_MAX_TOKENS": "16",
}


def _rows(csv_path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with csv_path.open(newline="") as handle:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}


async def _run_locust(host: str, csv_prefix: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(LOCUST), "-f", str(REPO / "kvgate" / "loadtest" / "locustfile.py"), "--headless", "-u", "4", "-r", "4",
        "-t", "5s", "--host", host, "--csv", str(csv_prefix), "--only-summary",
        cwd=REPO, env={**os.environ, **LOCUST_ENV},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout=45)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode, output.decode(errors="replace")


@pytest.mark.skipif(not LOCUST.exists(), reason="locust is not installed next to this Python")
async def test_locust_streams_chats_and_batches_through_kvgate_and_records_ttft(tmp_path: Path) -> None:
    fleet = await SimFleet.start([0, 0], FAST_SIM)
    try:
        async with running_gateway(endpoints=fleet.urls) as gateway:
            returncode, output = await _run_locust(gateway.url, tmp_path / "lt")
    finally:
        await fleet.stop()

    assert returncode == 0, output[-3000:]
    rows = _rows(tmp_path / "lt_stats.csv")
    chat_posts = rows[("POST", "chat")]
    assert int(chat_posts["Request Count"]) >= 10, output[-3000:]
    assert int(rows[("POST", "batch")]["Request Count"]) >= 1
    assert 1 <= int(rows[("GET", "/v1/models")]["Request Count"]) <= 4  # until the first answer, by each user at most
    assert all(int(row["Failure Count"]) == 0 for row in rows.values()), output[-3000:]
    ttft, e2e, itl = rows[("TTFT", "chat")], rows[("E2E", "chat")], rows[("ITL", "chat")]
    assert int(ttft["Request Count"]) == int(chat_posts["Request Count"])
    assert int(itl["Request Count"]) > int(ttft["Request Count"])
    # Streaming is measured as it arrives: the first token comes well before the end of a 16-token reply.
    assert float(ttft["Average Response Time"]) < 0.7 * float(e2e["Average Response Time"])
    assert float(itl["Average Response Time"]) > 0.5  # ms: the sim's steps are ~4 ms apart at speed 4
    assert int(rows[("TTFT", "batch")]["Request Count"]) >= 1
