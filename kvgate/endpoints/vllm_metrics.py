"""Turns a vLLM `/metrics` page into the ReplicaMetrics routing needs."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from prometheus_client.samples import Sample

from kvgate.endpoints.types import ReplicaMetrics
from kvgate.endpoints.prometheus_text import select_samples

KV_USAGE = "vllm:kv_cache_usage_perc"
LEGACY_KV_USAGE = "vllm:gpu_cache_usage_perc"  # same gauge before vLLM 0.11; removed in 0.12
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"
STEPS = "vllm:iteration_tokens_total_count"  # one observation per engine step
FINISHED = "vllm:request_prompt_tokens_count"  # one observation per finished request ...
PROMPT_TOKENS = "vllm:request_prompt_tokens_sum"  # ... of its prompt's length in tokens
_WANTED = (KV_USAGE, LEGACY_KV_USAGE, RUNNING, WAITING, CACHE_CONFIG, LORA_INFO, STEPS, FINISHED, PROMPT_TOKENS)


class MetricsPageError(ValueError):
    """A `/metrics` page lacks, or garbles, the vLLM gauges routing needs."""


def parse_vllm_metrics(page: str, scraped_at: float) -> ReplicaMetrics:
    """Fresh ReplicaMetrics from `page`, summing engines (data-parallel ranks) and models."""
    by_name: defaultdict[str, list[Sample]] = defaultdict(list)
    for sample in select_samples(page, _WANTED):
        if not math.isfinite(sample.value):
            raise MetricsPageError(f"{sample.name} is {sample.value}")
        by_name[sample.name].append(sample)
    usage = by_name[KV_USAGE] or by_name[LEGACY_KV_USAGE]
    required = {KV_USAGE: usage, RUNNING: by_name[RUNNING], WAITING: by_name[WAITING]}
    missing = [name for name, samples in required.items() if not samples]
    if missing:
        raise MetricsPageError(f"page lacks {','.join(missing)}")
    blocks_by_engine = _gpu_blocks_by_engine(by_name[CACHE_CONFIG])
    block_sizes = [int(s.labels["block_size"]) for s in by_name[CACHE_CONFIG]
                   if s.labels.get("block_size", "").isdigit()]
    lora = max(by_name[LORA_INFO], key=lambda s: s.value, default=None)  # old label sets linger; newest wins
    return ReplicaMetrics(
        kv_cache_usage=_kv_usage(usage, blocks_by_engine),
        running=round(sum(s.value for s in by_name[RUNNING])),
        waiting=round(sum(s.value for s in by_name[WAITING])),
        block_size=max(block_sizes, default=None),
        num_gpu_blocks=sum(blocks_by_engine.values()) or None,
        running_lora_adapters=_adapters(lora, "running_lora_adapters"),
        waiting_lora_adapters=_adapters(lora, "waiting_lora_adapters"),
        engine_steps=_total(by_name[STEPS]),
        finished_requests=_total(by_name[FINISHED]),
        finished_prompt_tokens=_total(by_name[PROMPT_TOKENS]),
        scraped_at=scraped_at,
        stale=False,
    )


def _total(samples: Sequence[Sample]) -> int | None:
    """The sum of a counter's samples over engines and models, None when the page does not export it."""
    return round(sum(s.value for s in samples)) if samples else None


def _gpu_blocks_by_engine(cache_config: Sequence[Sample]) -> dict[str, int]:
    """num_gpu_blocks per engine label; a label still "None" (cache not profiled yet) is left out."""
    return {s.labels.get("engine", ""): int(s.labels["num_gpu_blocks"])
            for s in cache_config if s.labels.get("num_gpu_blocks", "").isdigit()}


def _kv_usage(usage: Sequence[Sample], blocks_by_engine: Mapping[str, int]) -> float:
    """Fraction of all KV blocks in use: engines weighted by their block counts when every count is known."""
    weights = [blocks_by_engine.get(s.labels.get("engine", ""), 0) for s in usage]
    if all(weights):
        return sum(s.value * w for s, w in zip(usage, weights)) / sum(weights)
    return sum(s.value for s in usage) / len(usage)


def _adapters(lora: Sample | None, label: str) -> frozenset[str]:
    """The comma-joined adapter names in `label` of the newest lora_requests_info series."""
    if lora is None:
        return frozenset()
    return frozenset(name for name in lora.labels.get(label, "").split(",") if name)
