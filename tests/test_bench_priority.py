"""The priority benchmark: a tiny full run answers every request, and admission control beats FIFO for interactive."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from kvgate.loadtest.priority.client import (
    BATCH,
    INTERACTIVE,
    Arrival,
    Outcome,
    output_tokens,
    poisson_arrivals,
    request_body,
    run_open_loop,
)
from kvgate.engine.tokenizer import EngineTokenizer
from kvgate.loadtest.kit.report import BadOption
from kvgate.loadtest.priority.report import render_markdown
from kvgate.loadtest.priority.scenario import FLEETS, ROWS, plan_from
from kvgate.policies.config import RoutingConfig
from kvgate.policies.prefix_keys import build_request_info
from kvgate.simulator import SimOptions
from tests.bench_run import run_bench

TINY = ["--quick", "--duration", "3", "--unloaded-duration", "2", "--capacity-duration", "1", "--rows", "a,b,c,i"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One tiny run of the whole benchmark as its command: the JSON report and the docs file it wrote."""
    out = tmp_path_factory.mktemp("bench-priority")
    docs = out / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- bench:routing:start -->\nrouting table\n<!-- bench:routing:end -->\n")
    result = run_bench("priority", *TINY, "--out", str(out), "--docs", str(docs), timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    return orjson.loads((out / "priority.json").read_bytes()), docs.read_text()


def test_quick_run_answers_every_request(quick_run: tuple[dict[str, Any], str]) -> None:
    report, _ = quick_run
    for run in [report["unloaded"], *report["runs"]]:
        for name in ("interactive", "batch"):
            stats = run[name]
            assert stats["lost"] == 0, (run["key"], name, stats)
            assert stats["ok"] + stats["shed"] + stats["errors"] == stats["sent"]
    assert report["unloaded"]["interactive"]["ok"] > 0
    assert all(run["batch"]["ok"] > 0 for run in report["runs"] if run["key"] != report["without_batch"])


def test_report_has_the_unloaded_run_and_every_requested_row(quick_run: tuple[dict[str, Any], str]) -> None:
    report, docs = quick_run
    assert [run["key"] for run in report["runs"]] == ["a", "b", "c", "i"]
    assert report["capacity"]["measured_rps"] > 0
    assert [v["key"] for v in report["verdicts"]] == ["a"]  # only rows with admission control under the flood
    for row in ("| unloaded ", "| (a) ", "| (b) ", "| (c) ", "| (i) "):
        assert row in docs
    assert "- (i) without batch: " in docs and "against it: (a) " in docs
    assert "routing table" in docs  # another benchmark's section survives


def test_a_given_capacity_replaces_the_probe_in_the_plan_and_the_report(quick_run: tuple[dict[str, Any], str]) -> None:
    flags = dict(rows=None, duration=None, unloaded_duration=None, capacity_duration=None, replicas=None, seed=None,
                 quick=True, fleet="real")
    assert plan_from(argparse.Namespace(**flags, capacity=24.0)).capacity_rps == 24.0
    assert plan_from(argparse.Namespace(**flags, capacity=None)).capacity_rps is None  # probed
    with pytest.raises(BadOption, match="--capacity"):
        plan_from(argparse.Namespace(**flags, capacity=0.0))
    report, _ = quick_run
    assert report["capacity"]["rps"] == report["capacity"]["measured_rps"] > 0
    given = {**report, "capacity": {**report["capacity"], "rps": 24.0, "measured_rps": None}}
    assert "Capacity: 24.0 req/s as given" in render_markdown(given)


def test_a_full_run_lasts_until_its_p99_rests_on_enough_interactive_requests() -> None:
    flags = dict(rows=None, duration=20.0, unloaded_duration=None, capacity_duration=None, replicas=None, seed=None,
                 capacity=None, quick=False)
    kv_bound = plan_from(argparse.Namespace(**flags, fleet="kv-bound")).sized_for(5.2)
    # 20 % of 5.2 req/s (1.04) for 200 requests; 30 % of twice 5.2 req/s (3.12) for 200 requests
    assert (kv_bound.unloaded_s, kv_bound.overload_s) == (193.0, 65.0)
    assert (kv_bound.drain_cap_s, kv_bound.stall_s) == (5.0 * 65.0 + 30, 15.0)
    seats32 = plan_from(argparse.Namespace(**flags, fleet="seats32")).sized_for(43.1)
    assert (seats32.unloaded_s, seats32.overload_s) == (30.0, 20.0)  # 259 and 517 interactive requests already
    quick = plan_from(argparse.Namespace(**{**flags, "quick": True}, fleet="kv-bound")).sized_for(5.2)
    assert (quick.unloaded_s, quick.overload_s) == (8.0, 20.0)  # a quick run is a smoke test: its lengths hold


def test_row_i_sends_the_floods_interactive_requests_alone(quick_run: tuple[dict[str, Any], str]) -> None:
    report, _ = quick_run
    runs = {run["key"]: run for run in report["runs"]}
    assert report["without_batch"] == "i" and not ROWS["i"].judged and ROWS["g"].judged
    assert runs["i"]["batch"]["sent"] == 0
    assert runs["i"]["interactive"]["sent"] == runs["a"]["interactive"]["sent"] > 0  # the same schedule's share
    assert runs["i"]["offered_rps"] == round(runs["a"]["offered_rps"] * 0.3, 1)


def test_admission_control_gives_interactive_a_lower_ttft_p99_than_fifo(
        quick_run: tuple[dict[str, Any], str]) -> None:
    report, _ = quick_run
    runs = {run["key"]: run for run in report["runs"]}
    assert runs["a"]["interactive"]["ttft_p99_ms"] < runs["b"]["interactive"]["ttft_p99_ms"]
    assert runs["a"]["queues"]["gateway_queue_max"] > 0  # the fleet was saturated: requests waited in kvgate
    assert runs["b"]["queues"]["gateway_queue_max"] == 0


def test_the_report_says_how_full_the_replicas_ran(quick_run: tuple[dict[str, Any], str]) -> None:
    report, docs = quick_run
    runs = {run["key"]: run["queues"] for run in report["runs"]}
    assert runs["b"]["replica_running_mean"] > 0  # the flood kept the replicas running
    assert 0 < runs["b"]["replica_kv_use_mean"] <= 1
    assert runs["b"]["engine_preemptions"] >= 0 and 0 <= runs["b"]["prompt_cached"] <= 1
    assert report["unloaded"]["queues"]["replica_running_mean"] < runs["b"]["replica_running_mean"]
    assert "replica running / KV use mean" in docs


def test_poisson_schedule_stays_in_its_window_and_mixes_classes() -> None:
    arrivals = poisson_arrivals(rate=200.0, duration=5.0, batch_fraction=0.7, seed=3)
    assert 850 < len(arrivals) < 1150
    assert all(0 <= a.at < 5.0 for a in arrivals)
    assert [a.at for a in arrivals] == sorted(a.at for a in arrivals)
    batch = sum(1 for a in arrivals if a.priority == BATCH) / len(arrivals)
    assert 0.65 < batch < 0.75
    assert arrivals == poisson_arrivals(rate=200.0, duration=5.0, batch_fraction=0.7, seed=3)


def test_the_flood_lands_on_interactive_traffic_already_flowing() -> None:
    arrivals = poisson_arrivals(rate=200.0, duration=5.0, batch_fraction=0.7, seed=3, lead_in_s=2.0)
    lead_in = [a for a in arrivals if a.at < 2.0]
    assert lead_in and all(a.priority == INTERACTIVE and a.lead_in for a in lead_in)
    assert 90 < len(lead_in) < 150  # the interactive share (30 %) of 200 req/s for two seconds
    flood = [a for a in arrivals if a.at >= 2.0]
    assert not any(a.lead_in for a in flood) and max(a.at for a in flood) < 7.0
    assert [a.index for a in arrivals] == list(range(len(arrivals)))


def test_output_lengths_vary_around_their_mean() -> None:
    lengths = [output_tokens(index, 32) for index in range(2000)]
    assert min(lengths) == 16 and max(lengths) == 48
    assert 31 < sum(lengths) / len(lengths) < 33
    assert lengths == [output_tokens(index, 32) for index in range(2000)]


async def _shed(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "saturated"}}, status=429, headers={"Retry-After": "2"})


async def _truncated_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
    return response  # no [DONE]


async def _late_answer(request: web.Request, delay: float) -> web.StreamResponse:
    await asyncio.sleep(delay)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n')
    return response


async def _silent(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(30)
    return web.Response()


@pytest.fixture
async def odd_server() -> AsyncIterator[str]:
    """A server that answers by the request's class: 429 for batch; for interactive, by the body: silence, a whole
    answer after `delay` seconds, or a stream cut short."""
    async def route(request: web.Request) -> web.StreamResponse:
        if request.headers["x-priority"] == BATCH:
            return await _shed(request)
        body = await request.json()
        if body["silent"]:
            return await _silent(request)
        return await (_late_answer(request, body["delay"]) if "delay" in body else _truncated_stream(request))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", route)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_client_tells_shed_broken_and_unanswered_requests_apart(odd_server: str) -> None:
    arrivals = [Arrival(0, 0.0, BATCH), Arrival(1, 0.01, INTERACTIVE), Arrival(2, 0.02, INTERACTIVE)]
    samples = await run_open_loop(odd_server, arrivals, lambda arrival: orjson.dumps({"silent": arrival.index == 2}),
                                  drain_cap=30.0, stall_s=0.5)
    shed, broken, unanswered = samples
    assert (shed.outcome, shed.retry_after) == (Outcome.SHED, "2")
    assert broken.outcome is Outcome.ERROR and broken.ttft is not None
    assert "without [DONE]" in broken.detail
    assert unanswered.outcome is Outcome.LOST


async def test_the_drain_waits_while_answers_keep_ending_and_stops_when_they_stall(odd_server: str) -> None:
    """Answers ending 0.4 s apart outlast a 0.6 s stall window together, and are all counted; the silent request
    (answered after 30 s) is lost once nothing else ends for 0.6 s, long before the 30 s cap."""
    arrivals = [Arrival(index, 0.0, INTERACTIVE) for index in range(6)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    samples = await run_open_loop(
        odd_server, arrivals,
        lambda arrival: orjson.dumps({"silent": arrival.index == 5, "delay": 0.4 * (arrival.index + 1)}),
        drain_cap=30.0, stall_s=0.6)
    assert [sample.outcome for sample in samples] == [Outcome.OK] * 5 + [Outcome.LOST]
    assert loop.time() - started < 10.0


def test_rows_run_as_deployed_unless_they_measure_a_difference() -> None:
    sim = SimOptions(max_num_seqs=32)
    assert ["--saturation-seats", "32"] == ROWS["a"].gateway_flags(sim)[2:4]
    assert "--saturation-seats" not in ROWS["e"].gateway_flags(sim)
    fifo = ROWS["b"].gateway_flags(sim)
    assert "--saturation-seats" not in fifo and fifo[fifo.index("--admission-preemptible") + 1] == ""
    assert ROWS["a"].sim_options(sim).priority_scheduling and "--upstream-priority" in ROWS["a"].gateway_flags(sim)
    for key in ("b", "d"):
        assert not ROWS[key].sim_options(sim).priority_scheduling and "--upstream-priority" not in ROWS[key].gateway_flags(sim)


def test_rows_without_configuration_give_kvgate_no_flag_at_all() -> None:
    sim = SimOptions(max_num_seqs=8)
    for key in ("g", "h"):
        assert ROWS[key].gateway_flags(sim) == [] and not ROWS[key].sim_options(sim).priority_scheduling
    assert ROWS["g"].batch_stream and not ROWS["h"].batch_stream


def test_the_kv_bound_fleet_fills_its_cache_before_its_seats() -> None:
    kv_bound = FLEETS["kv-bound"]
    sim = kv_bound["sim"]
    prompt_tokens = kv_bound["prompt_words"] * 6 / 4  # the simulator's 4 characters per token, ~6 per word
    assert sim.num_gpu_blocks * sim.block_size < sim.max_num_seqs * prompt_tokens


def test_the_tokenized_kv_bound_fleet_holds_fewer_prompts_than_four_characters_a_token_say(tiny_model_dir) -> None:
    fleet = FLEETS["kv-bound-tokenized"]
    sim = fleet["sim"]
    body = orjson.loads(request_body(sim.models[0], 0, fleet["prompt_words"], 32))
    tokens = len(EngineTokenizer.load(str(tiny_model_dir)).request_ids("chat", body))
    estimate = build_request_info("chat", body, "interactive", RoutingConfig()).prompt_chars / 4
    cache = sim.num_gpu_blocks * sim.block_size
    assert cache // tokens < sim.max_num_seqs <= cache // estimate  # the cache binds; at 4 a token, the seats would


def test_the_chat_fleets_requests_share_more_system_prompts_than_a_replicas_cache_holds() -> None:
    flags = dict(rows=None, duration=None, unloaded_duration=None, capacity_duration=None, replicas=None,
                 capacity=None, quick=False, fleet="kv-bound-chat")
    plan = plan_from(argparse.Namespace(**flags, seed=5))
    bodies = [orjson.loads(plan.body_for(Arrival(index, 0.0, INTERACTIVE))) for index in range(400)]
    systems = [body["messages"][0]["content"] for body in bodies]
    assert all(body["messages"][0]["role"] == "system" for body in bodies)
    assert len(set(systems)) == plan.tenants == 24  # every tenant drawn, each prompt shared by many requests
    assert len({body["messages"][1]["content"] for body in bodies}) == 400  # each question its own
    reseeded = plan_from(argparse.Namespace(**flags, seed=6))
    assert [reseeded.system_prompt_of(index) for index in range(400)] != systems
    cache_tokens = plan.sim.num_gpu_blocks * plan.sim.block_size
    assert 1 < cache_tokens // (plan.system_prompt_chars / 4) < plan.tenants / plan.replicas  # caches under pressure
    assert plan_from(argparse.Namespace(**{**flags, "fleet": "kv-bound"}, seed=5)).system_prompt_of(0) == ""


def test_a_burst_through_kvgate_answers_every_stream(tmp_path: Path) -> None:
    result = run_bench("burst", "--quick", "--out", str(tmp_path), timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    report = orjson.loads((tmp_path / "burst.json").read_bytes())
    [kvgate] = report["routers"]["kvgate"]
    assert kvgate["ok"] == report["streams"] == 50 and kvgate["failed"] == 0
    assert 0 < kvgate["ttft_p50_ms"] <= kvgate["ttft_p99_ms"]
