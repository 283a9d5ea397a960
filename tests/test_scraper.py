"""MetricsScraper and the /metrics parsing behind it, against real aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvgate.endpoints.types import UNSCRAPED
from kvgate.endpoints.prometheus_text import select_samples
from kvgate.endpoints.scraper import MetricsScraper
from kvgate.endpoints.vllm_metrics import MetricsPageError, parse_vllm_metrics
from kvgate.loadtest.kit.vllm_metrics_page import LEGACY_KV_USAGE, EngineLoad, LoraSeries, render_vllm_metrics
from tests.fake_vllm_replica import refused_endpoint
from tests.harness import FakeClock, wait_until
from tests.metrics_shape import REAL_PAGE

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def test_reads_load_cache_size_and_newest_lora_series_from_a_two_engine_page(session, start_replica):
    page = render_vllm_metrics(
        [EngineLoad(running=3, waiting=1, kv_cache_usage=0.5, num_gpu_blocks=1000),
         EngineLoad(running=4, waiting=2, kv_cache_usage=0.25, num_gpu_blocks=3000)],
        block_size=32,
        lora=[LoraSeries(1.70e9, running=("sql-lora", "chat-lora"), waiting=("math-lora",)),
              LoraSeries(1.80e9, running=("sql-lora",)),
              LoraSeries(1.75e9, running=("old-lora",))],
    )
    replica = await start_replica(page=page)
    clock = FakeClock()
    scraper = MetricsScraper(lambda: session, clock=clock)
    scraper.set_endpoints([replica.endpoint])

    await scraper.scrape_once()

    metrics = scraper.metrics(replica.endpoint.key)
    assert (metrics.running, metrics.waiting) == (7, 3)
    assert metrics.kv_cache_usage == pytest.approx((0.5 * 1000 + 0.25 * 3000) / 4000)
    assert (metrics.block_size, metrics.num_gpu_blocks) == (32, 4000)
    assert metrics.running_lora_adapters == frozenset({"sql-lora"})
    assert metrics.waiting_lora_adapters == frozenset()
    assert metrics.scraped_at == clock.now and not metrics.stale


async def test_falls_back_to_gpu_cache_usage_perc_on_old_vllm(session, start_replica):
    page = render_vllm_metrics([EngineLoad(kv_cache_usage=0.75)], kv_usage_names=(LEGACY_KV_USAGE,))
    replica = await start_replica(page=page)
    scraper = MetricsScraper(lambda: session)
    scraper.set_endpoints([replica.endpoint])

    await scraper.scrape_once()

    assert scraper.metrics(replica.endpoint.key).kv_cache_usage == 0.75
    assert not scraper.metrics(replica.endpoint.key).stale


def test_prefers_kv_cache_usage_perc_when_both_names_are_present():
    page = f"""# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.9
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.4375
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2.0
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 3.0
"""
    assert parse_vllm_metrics(page, scraped_at=1.0).kv_cache_usage == 0.4375


def test_sums_requests_over_model_names_and_tolerates_unprofiled_cache_config():
    page = f"""vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.5
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2.0
vllm:num_requests_running{{engine="0",model_name="other"}} 5.0
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
vllm:num_requests_waiting{{engine="0",model_name="other"}} 4.0
vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="None"}} 1.0
"""
    metrics = parse_vllm_metrics(page, scraped_at=1.0)
    assert (metrics.running, metrics.waiting, metrics.block_size) == (7, 5, 16)
    assert metrics.num_gpu_blocks is None and metrics.kv_capacity_tokens is None


def test_page_without_the_load_gauges_is_an_error():
    with pytest.raises(MetricsPageError, match="vllm:num_requests_waiting"):
        parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:num_requests_running 1\n', 1.0)


def test_malformed_wanted_line_is_an_error_but_unrelated_garbage_is_never_read():
    assert select_samples('garbage {{{ "\nvllm:x{a="1"} 2\n', ["vllm:x"])[0].value == 2.0
    with pytest.raises(ValueError):
        select_samples('vllm:x{a="1} 2\n', ["vllm:x"])


def test_selection_matches_prometheus_client_on_a_realistic_page():
    page = render_vllm_metrics([EngineLoad(running=2, kv_cache_usage=0.3)] * 2, lora=[LoraSeries(1.7e9, ("a", "b"))])
    names = {"vllm:num_requests_running", "vllm:cache_config_info", "vllm:lora_requests_info", "vllm:prompt_tokens"}
    expected = [(s.name, s.labels, s.value) for family in text_string_to_metric_families(page)
                for s in family.samples if s.name in names]

    got = [(s.name, s.labels, s.value) for s in select_samples(page, names)]

    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert not any(name == "vllm:prompt_tokens" for name, _, _ in got)  # only vllm:prompt_tokens_total exists


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@settings(max_examples=200, deadline=None)
@given(labels=st.dictionaries(st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,8}", fullmatch=True),  # "__*" is reserved
                              st.text(max_size=12), max_size=4),
       value=st.floats(allow_nan=False, width=64))
def test_sample_parsing_agrees_with_prometheus_client(labels, value):
    body = ",".join(f'{key}="{_escaped(text)}"' for key, text in labels.items())
    line = f"vllm:lora_requests_info{{{body}}} {value!r}\n"
    (expected,) = [s for family in text_string_to_metric_families(line) for s in family.samples]

    (got,) = select_samples(line, ["vllm:lora_requests_info"])

    assert (got.name, got.labels, got.value) == (expected.name, expected.labels, expected.value)


async def test_http_500_marks_stale_and_keeps_the_last_values(session, start_replica):
    replica = await start_replica(page=render_vllm_metrics([EngineLoad(running=5, waiting=2)]))
    scraper = MetricsScraper(lambda: session)
    scraper.set_endpoints([replica.endpoint])
    await scraper.scrape_once()
    before = scraper.metrics(replica.endpoint.key)

    replica.status = 500
    await scraper.scrape_once()

    after = scraper.metrics(replica.endpoint.key)
    assert after.stale and not before.stale
    assert (after.running, after.waiting, after.scraped_at) == (5, 2, before.scraped_at)


async def test_unparsable_page_marks_stale(session, start_replica):
    replica = await start_replica(page="<html><body>Not Found</body></html>")
    scraper = MetricsScraper(lambda: session)
    scraper.set_endpoints([replica.endpoint])

    await scraper.scrape_once()

    assert scraper.metrics(replica.endpoint.key) == UNSCRAPED
    assert replica.hits["/metrics"] == 1


async def test_slow_replica_times_out_without_delaying_the_fast_one(session, start_replica):
    fast = await start_replica()
    slow = await start_replica(delay_s=5.0)
    scraper = MetricsScraper(lambda: session, interval_s=0.5, timeout_s=0.5)
    scraper.set_endpoints([slow.endpoint, fast.endpoint])

    started = time.monotonic()
    await scraper.scrape_once()
    round_s = time.monotonic() - started

    fast_metrics, slow_metrics = scraper.metrics(fast.endpoint.key), scraper.metrics(slow.endpoint.key)
    assert not fast_metrics.stale and fast_metrics.scraped_at - started < 0.25  # done long before the timeout
    assert slow_metrics.stale and slow_metrics.scraped_at is None
    assert 0.45 < round_s < 2.0  # bounded by the timeout, not by the slow replica's 5 s


async def test_connection_refused_marks_stale_and_reports_the_failure(session):
    endpoint = refused_endpoint()
    results: list[tuple[str, bool]] = []
    rounds: list[None] = []
    scraper = MetricsScraper(lambda: session)
    scraper.add_result_listener(lambda key, ok, duration_s: results.append((key, ok)))
    scraper.add_round_listener(lambda: rounds.append(None))
    scraper.set_endpoints([endpoint])

    await scraper.scrape_once()

    assert scraper.metrics(endpoint.key).stale
    assert results == [(endpoint.key, False)] and len(rounds) == 1


async def test_metrics_go_stale_by_age_even_without_failed_scrapes(session, start_replica):
    replica = await start_replica(page=render_vllm_metrics([EngineLoad(waiting=4)]))
    clock = FakeClock()
    scraper = MetricsScraper(lambda: session, interval_s=0.2, stale_after_s=1.0, clock=clock)
    scraper.set_endpoints([replica.endpoint])
    await scraper.scrape_once()

    clock.now += 0.9
    assert not scraper.metrics(replica.endpoint.key).stale
    clock.now += 0.2
    aged = scraper.metrics(replica.endpoint.key)
    assert aged.stale and aged.waiting == 4


async def test_recovers_after_failures_and_logs_once_per_transition(session, start_replica, caplog):
    replica = await start_replica(status=503)
    scraper = MetricsScraper(lambda: session)
    scraper.set_endpoints([replica.endpoint])
    caplog.set_level(logging.INFO, logger="kvgate.endpoints")

    for _ in range(4):
        await scraper.scrape_once()
    replica.status = 200
    replica.page = render_vllm_metrics([EngineLoad(running=9)])
    await scraper.scrape_once()
    await scraper.scrape_once()

    metrics = scraper.metrics(replica.endpoint.key)
    assert not metrics.stale and metrics.running == 9
    messages = [record.getMessage() for record in caplog.records]
    assert [m.split(" endpoint=")[0] for m in messages] == ["metrics scrape failing", "metrics scrape recovered"]
    assert "status=503" in messages[0] and "failed_polls=4" in messages[1]
    assert not any(record.exc_info for record in caplog.records)  # expected failures: no traceback


async def test_removed_endpoint_is_no_longer_scraped(session, start_replica):
    kept, removed = await start_replica(), await start_replica()
    scraper = MetricsScraper(lambda: session, interval_s=0.05, timeout_s=0.05)
    scraper.set_endpoints([kept.endpoint, removed.endpoint])
    task = asyncio.create_task(scraper.run())
    try:
        await wait_until(lambda: removed.hits["/metrics"] >= 2)
        scraper.set_endpoints([kept.endpoint])
        await asyncio.sleep(0.1)  # a scrape already on the wire may still land
        hits_after_removal, kept_hits = removed.hits["/metrics"], kept.hits["/metrics"]
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
    assert removed.hits["/metrics"] == hits_after_removal
    assert kept.hits["/metrics"] >= kept_hits + 3  # the loop itself kept going
    assert scraper.metrics(removed.endpoint.key) == UNSCRAPED


async def test_rounds_never_overlap_on_a_replica_slower_than_the_interval(session, start_replica):
    slow = await start_replica(delay_s=1.0)
    scraper = MetricsScraper(lambda: session, interval_s=0.05, timeout_s=0.04)
    scraper.set_endpoints([slow.endpoint])
    task = asyncio.create_task(scraper.run())
    try:
        await wait_until(lambda: slow.hits["/metrics"] >= 5)
    finally:
        task.cancel()
    assert slow.max_in_flight == 1
    assert scraper.metrics(slow.endpoint.key).stale


async def test_a_page_slower_than_the_interval_delays_only_its_own_replica_and_stays_fresh(session, start_replica):
    """A busy vLLM engine takes up to ~0.8 s to render /metrics: that is a slow scrape, not a stale replica."""
    slow, fast = await start_replica(delay_s=0.3), await start_replica()
    scraper = MetricsScraper(lambda: session, interval_s=0.05, timeout_s=1.0)
    scraper.set_endpoints([slow.endpoint, fast.endpoint])
    task = asyncio.create_task(scraper.run())
    try:
        await wait_until(lambda: slow.hits["/metrics"] >= 3, timeout=5)
        assert fast.hits["/metrics"] >= 3 * slow.hits["/metrics"]  # the fast one kept its own pace
        assert not scraper.metrics(slow.url).stale and scraper.metrics(slow.url).running == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: slow.in_flight == 0, timeout=2)  # cancelling run() cancels the scrape in flight


def test_rejects_a_non_positive_timeout(session):
    with pytest.raises(ValueError, match="must be positive"):
        MetricsScraper(lambda: session, interval_s=0.2, timeout_s=0)


def test_finished_requests_and_their_prompt_tokens_are_read_from_a_real_page() -> None:
    metrics = parse_vllm_metrics(REAL_PAGE.read_text(), 1.0)
    assert (metrics.finished_requests, metrics.finished_prompt_tokens) == (8, 144)
    page = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
    assert parse_vllm_metrics(page, 1.0).finished_requests is None  # not exported: nothing to learn from


def test_engine_steps_are_read_from_the_iteration_histogram_of_a_real_page() -> None:
    assert parse_vllm_metrics(REAL_PAGE.read_text(), 1.0).engine_steps == 677  # one engine, 677 steps
    page = "\n".join(line for line in REAL_PAGE.read_text().splitlines() if "iteration_tokens" not in line)
    assert parse_vllm_metrics(page, 1.0).engine_steps is None
