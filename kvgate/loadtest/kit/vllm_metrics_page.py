"""Realistic vLLM `/metrics` pages (V1 engine families, HTTP and process metrics) for tests and benchmarks, rendered
by prometheus_client itself as a vLLM server built on it prints them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvgate.simulator.metrics import ITERATION_BUCKETS

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KV_USAGE = "vllm:kv_cache_usage_perc"
LEGACY_KV_USAGE = "vllm:gpu_cache_usage_perc"

_ENGINE_LABELS = ("engine", "model_name")
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                          7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_HISTOGRAMS = {  # name -> (buckets, typical observed value)
    "vllm:time_to_first_token_seconds": (_TTFT_BUCKETS, 0.3),
    "vllm:time_per_output_token_seconds": (_TOKEN_LATENCY_BUCKETS, 0.03),
    "vllm:inter_token_latency_seconds": (_TOKEN_LATENCY_BUCKETS, 0.03),
    "vllm:e2e_request_latency_seconds": (_LATENCY_BUCKETS, 6.0),
    "vllm:request_queue_time_seconds": (_LATENCY_BUCKETS, 0.5),
    "vllm:request_inference_time_seconds": (_LATENCY_BUCKETS, 5.0),
    "vllm:request_prefill_time_seconds": (_LATENCY_BUCKETS, 0.3),
    "vllm:request_decode_time_seconds": (_LATENCY_BUCKETS, 4.7),
    "vllm:request_prompt_tokens": (_TOKEN_COUNT_BUCKETS, 2000),
    "vllm:request_generation_tokens": (_TOKEN_COUNT_BUCKETS, 300),
    "vllm:request_params_max_tokens": (_TOKEN_COUNT_BUCKETS, 1024),
    "vllm:request_params_n": ((1, 2, 5, 10, 20), 1),
    "vllm:iteration_tokens_total": (ITERATION_BUCKETS, 256),
}
_HTTP_HANDLERS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load gauges and cache size as its page reports them."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    num_gpu_blocks: int = 4096


@dataclass(frozen=True)
class LoraSeries:
    """One `vllm:lora_requests_info` label set; its value is the unix time it was last set."""

    timestamp: float
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_lora: int = 4


def render_vllm_metrics(
    engines: Sequence[EngineLoad] = (EngineLoad(),),
    *,
    model: str = DEFAULT_MODEL,
    block_size: int = 16,
    lora: Sequence[LoraSeries] = (),
    kv_usage_names: Sequence[str] = (KV_USAGE,),
    requests_seen: int = 50,
    seed: int = 0,
) -> str:
    """A `/metrics` page of a vLLM server running `engines` (data-parallel engines of one model)."""
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    _add_http_metrics(registry, requests_seen)
    _add_engine_metrics(registry, engines, model, kv_usage_names, requests_seen, random.Random(seed))
    cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         ("block_size", "cache_dtype", "enable_prefix_caching", "engine", "gpu_memory_utilization",
                          "num_cpu_blocks", "num_gpu_blocks"), registry=registry)
    for index, engine in enumerate(engines):
        cache_config.labels(str(block_size), "auto", "True", str(index), "0.9", "None",
                            str(engine.num_gpu_blocks)).set(1)
    lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                      ("max_lora", "running_lora_adapters", "waiting_lora_adapters"), registry=registry)
    for series in lora:
        lora_info.labels(str(series.max_lora), ",".join(series.running), ",".join(series.waiting)).set(series.timestamp)
    return generate_latest(registry).decode()


def _add_engine_metrics(
    registry: CollectorRegistry,
    engines: Sequence[EngineLoad],
    model: str,
    kv_usage_names: Sequence[str],
    requests_seen: int,
    rng: random.Random,
) -> None:
    gauges = {
        "running": Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                         _ENGINE_LABELS, registry=registry),
        "waiting": Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                         _ENGINE_LABELS, registry=registry),
    }
    usage_gauges = [Gauge(name, "KV-cache usage. 1 means 100 percent usage.", _ENGINE_LABELS, registry=registry)
                    for name in kv_usage_names]
    counters = [Counter(name, name, _ENGINE_LABELS, registry=registry) for name in (
        "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")]
    success = Counter("vllm:request_success", "Count of successfully processed requests.",
                      ("engine", "finished_reason", "model_name"), registry=registry)
    histograms = [Histogram(name, name, _ENGINE_LABELS, buckets=buckets, registry=registry)
                  for name, (buckets, _) in _HISTOGRAMS.items()]
    typical_values = [typical for _, typical in _HISTOGRAMS.values()]
    for index, engine in enumerate(engines):
        labels = (str(index), model)
        gauges["running"].labels(*labels).set(engine.running)
        gauges["waiting"].labels(*labels).set(engine.waiting)
        for gauge in usage_gauges:
            gauge.labels(*labels).set(engine.kv_cache_usage)
        for counter in counters:
            counter.labels(*labels).inc(rng.randrange(1, 10_000_000))
        for reason in ("stop", "length", "abort"):
            success.labels(labels[0], reason, model).inc(rng.randrange(requests_seen + 1))
        for histogram, typical in zip(histograms, typical_values):
            child = histogram.labels(*labels)
            for _ in range(requests_seen):
                child.observe(rng.lognormvariate(0, 1) * typical)


def _add_http_metrics(registry: CollectorRegistry, requests_seen: int) -> None:
    """The families prometheus-fastapi-instrumentator adds to vLLM's API server."""
    requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                       ("handler", "method", "status"), registry=registry)
    request_size = Summary("http_request_size_bytes", "Content length of incoming requests.", ("handler",),
                           registry=registry)
    response_size = Summary("http_response_size_bytes", "Content length of outgoing responses.", ("handler",),
                            registry=registry)
    duration_highr = Histogram("http_request_duration_highr_seconds", "Latency with many buckets.",
                               buckets=[round(0.01 * 1.25 ** i, 4) for i in range(30)], registry=registry)
    duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler.",
                         ("handler", "method"), buckets=(0.1, 0.5, 1.0), registry=registry)
    for handler in _HTTP_HANDLERS:
        method = "POST" if handler.startswith("/v1/c") else "GET"
        requests.labels(handler, method, "2xx").inc(requests_seen)
        request_size.labels(handler).observe(2048)
        response_size.labels(handler).observe(4096)
        duration.labels(handler, method).observe(0.2)
        duration_highr.observe(0.2)
