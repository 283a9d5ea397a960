"""The replica's `/metrics` page: vLLM's metric names and labels in a private registry per replica."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvgate.simulator.options import SimOptions
from kvgate.simulator.scheduler import EngineCore, EngineTotals, FinishReason, Sequence, StepOutcome

# Bucket bounds as vLLM declares them.
# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# fmt: on


def _request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    return tuple(bound for exponent in range(len(str(max_model_len))) for mantissa in (1, 2, 5)
                 if (bound := mantissa * 10**exponent) <= max_model_len)

_ENGINE_LABELS = ("engine", "model_name")  # sorted, as vLLM prints them
MetricT = TypeVar("MetricT", Gauge, Counter, Histogram)

# EngineTotals field -> exported counter name (without the _total suffix prometheus_client adds).
_TOTAL_COUNTERS = {
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "prompt_tokens": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
}


# Families on vLLM 0.32's page that the simulator does not model: the same name, type and label names, at zero,
# so that a scraper written against the simulator meets the real page's shape (tests/fixtures holds the real one).
_UNMODELLED: tuple[tuple[type, str, str, str | None, tuple[str, ...]], ...] = (
    # (kind, name, help, a label beside engine and model_name, that label's values)
    (Counter, "vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU.", None, ()),
    (Counter, "vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU.", None, ()),
    (Counter, "vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU.", None, ()),
    (Counter, "vllm:external_prefix_cache_queries", "External prefix cache queries, in tokens.", None, ()),
    (Counter, "vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens.", None, ()),
    (Counter, "vllm:mm_cache_queries", "Multi-modal cache queries, in items.", None, ()),
    (Counter, "vllm:mm_cache_hits", "Multi-modal cache hits, in items.", None, ()),
    (Counter, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source",
     ("local_compute", "local_cache_hit", "external_kv_transfer")),
    (Counter, "vllm:prompt_tokens_cached", "Number of cached prompt tokens.", None, ()),
    (Counter, "vllm:prompt_tokens_cached_by_source", "Number of cached prompt tokens by source.", "source",
     ("device", "host", "p2p", "disk", "external_unspecified")),
    (Gauge, "vllm:engine_sleep_state", "Engine sleep state.", "sleep_state", ("awake", "weights_offloaded", "discard_all")),
    (Histogram, "vllm:request_generation_tokens", "Number of generation tokens processed.", None, ()),
    (Histogram, "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested tokens.", None, ()),
    (Histogram, "vllm:request_params_n", "Histogram of the n request parameter.", None, ()),
    (Histogram, "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", None, ()),
    (Histogram, "vllm:request_time_per_output_token_seconds", "Histogram of time per output token in seconds.", None, ()),
    (Histogram, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", None, ()),
    (Histogram, "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", None, ()),
    (Histogram, "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", None, ()),
    (Histogram, "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", None, ()),
    (Histogram, "vllm:request_num_preemptions", "Number of preemptions per request.", None, ()),
    (Histogram, "vllm:request_prefill_kv_computed_tokens", "Prefill tokens computed, excluding cached ones.", None, ()),
)  # fmt: skip


def _cache_config_labels(options: SimOptions, engine: str) -> dict[str, str]:
    """vLLM 0.32's cache_config_info labels, with the simulator's own values where it has them."""
    return {
        "_block_size_resolved": "True", "block_size": str(options.block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(options.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": str(options.enable_prefix_caching),
        "engine": engine, "gpu_memory_utilization": "0.92", "hash_block_size": "None", "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(options.num_gpu_blocks * options.block_size / options.max_model_len),
        "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": str(options.num_gpu_blocks * options.block_size),
        "kv_offloading_backend": "native", "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32", "num_cpu_blocks": "None",
        "num_gpu_blocks": str(options.num_gpu_blocks), "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0", "prefix_caching_hash_algo": "sha256_cbor", "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "False",
    }  # fmt: skip


class EngineMetrics:
    """vLLM engine metrics of one replica, fed from its EngineCore after every change."""

    def __init__(self, options: SimOptions, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        model = options.models[0]

        def engine_metric(kind: type[MetricT], name: str, doc: str, **kwargs: Any) -> MetricT:
            """One child of an engine metric labelled {engine, model_name}."""
            return kind(name, doc, _ENGINE_LABELS, registry=self.registry, **kwargs).labels(engine, model)

        self._running = engine_metric(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self._waiting = engine_metric(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
                          ("engine", "model_name", "reason"), registry=self.registry)
        self._waiting_for_capacity = by_reason.labels(engine, model, "capacity")
        by_reason.labels(engine, model, "deferred").set(0)
        self._usage = [engine_metric(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")]
        if options.legacy_cache_metric:
            self._usage.append(
                engine_metric(Gauge, "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
            )
        self._totals = {field: engine_metric(Counter, name, doc) for field, (name, doc) in _TOTAL_COUNTERS.items()}
        self._ttft = engine_metric(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=_TTFT_BUCKETS,
        )
        self._e2e = engine_metric(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=_E2E_BUCKETS,
        )
        self._itl = engine_metric(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=_ITL_BUCKETS,
        )
        self._iteration_tokens = engine_metric(
            Histogram,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets=ITERATION_BUCKETS,
        )
        self._prompt_tokens = engine_metric(
            Histogram,
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            buckets=_request_tokens_buckets(options.max_model_len),
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("engine", "finished_reason", "model_name"),
            registry=self.registry,
        )
        # vLLM creates every finished_reason series up front, so all three read 0 before use.
        self._success = {reason: success.labels(engine, reason.value, model) for reason in FinishReason}
        config_labels = _cache_config_labels(options, engine)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", tuple(config_labels),
              registry=self.registry).labels(**config_labels).set(1)
        unmodelled = {}
        for kind, name, doc, label, values in _UNMODELLED:
            family = unmodelled[name] = kind(name, doc, (*_ENGINE_LABELS, *([label] if label else [])),
                                             registry=self.registry)
            for value in values or (None,):
                family.labels(engine, model, *([] if value is None else [value]))
        unmodelled["vllm:engine_sleep_state"].labels(engine, model, "awake").set(1)
        rejections = Counter("vllm:admission_rejections", "Requests rejected at admission.", ("model_name", "reason"),
                             registry=self.registry)
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.labels(model, reason)
        self._lora_info = None
        if options.lora_adapters:
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                registry=self.registry,
            )
        self._max_lora = str(options.max_loras)
        self._num_gpu_blocks = options.num_gpu_blocks
        self._published = EngineTotals()

    def publish(self, core: EngineCore) -> None:
        """Bring gauges and counters up to date with the engine core."""
        self._running.set(len(core.running))
        self._waiting.set(core.num_waiting)
        self._waiting_for_capacity.set(core.num_waiting)
        usage = core.cache.pinned_blocks / self._num_gpu_blocks
        for gauge in self._usage:
            gauge.set(usage)
        for field, counter in self._totals.items():
            delta = getattr(core.totals, field) - getattr(self._published, field)
            if delta:
                counter.inc(delta)
        self._published = dataclasses.replace(core.totals)
        if self._lora_info is not None:
            # vLLM leaves old label sets on the page; the newest timestamp marks the current one.
            self._lora_info.labels(self._max_lora, ",".join(core.running_loras()), ",".join(core.waiting_loras())).set(
                time.time()
            )

    def observe_step(self, outcome: StepOutcome, now: float, num_tokens: int) -> None:
        """Record one engine step: the tokens it computed, token latencies and completions."""
        self._iteration_tokens.observe(num_tokens)
        for seq in outcome.advanced:
            if seq.last_token_time != now:
                continue
            if len(seq.output_ids) == 1:
                self._ttft.observe(now - seq.arrival_time)
            else:
                self._itl.observe(seq.last_token_gap)
        for seq in outcome.finished:
            self.observe_finished(seq, now)

    def observe_finished(self, seq: Sequence, now: float) -> None:
        """Count a finished (or aborted) sequence."""
        self._success[seq.finish_reason].inc()
        if seq.finish_reason is not FinishReason.ABORT:  # vLLM records no request stats for a client's abort
            self._e2e.observe(now - seq.arrival_time)
            self._prompt_tokens.observe(seq.num_prompt_tokens)

    def render(self) -> bytes:
        """The Prometheus text page."""
        return generate_latest(self.registry)
