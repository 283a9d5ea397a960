"""Times kvgate's parse of a ~150 KB vLLM /metrics page against prometheus_client's full parse of it.

Run: python -m kvgate.loadtest.bench_scrape_parse [--engines 4] [--repeat 200]
"""

from __future__ import annotations

import argparse
import timeit

from prometheus_client.parser import text_string_to_metric_families

from kvgate.endpoints.prometheus_text import select_samples
from kvgate.endpoints.vllm_metrics import parse_vllm_metrics
from kvgate.loadtest.vllm_metrics_page import EngineLoad, LoraSeries, render_vllm_metrics

_NAMES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:cache_config_info", "vllm:lora_requests_info")


def _full_parse(page: str) -> int:
    """What a scraper that parses every family does: every sample of the page, then pick the wanted ones."""
    return sum(1 for family in text_string_to_metric_families(page) for sample in family.samples
               if sample.name in _NAMES)


def _best_us(statement: object, repeat: int) -> float:
    """Best-of-5 mean microseconds per call of `statement`."""
    return min(timeit.repeat(statement, number=repeat, repeat=5)) / repeat * 1e6


def main() -> None:
    """Print page size, microseconds per parse for each approach, and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=4, help="data-parallel engines on the page (4 -> ~150 KB)")
    parser.add_argument("--repeat", type=int, default=200, help="parses per timing sample")
    args = parser.parse_args()
    engines = [EngineLoad(running=3, waiting=1, kv_cache_usage=0.4, num_gpu_blocks=4096)] * args.engines
    page = render_vllm_metrics(engines, lora=[LoraSeries(1.7e9, ("sql-lora",)), LoraSeries(1.6e9)])
    assert _full_parse(page) == len(select_samples(page, _NAMES)), "both parsers must see the same samples"

    wanted_lines = "\n".join(line for line in page.splitlines() if line.startswith(_NAMES)) + "\n"

    ours = _best_us(lambda: parse_vllm_metrics(page, scraped_at=0.0), args.repeat)
    selection_only = _best_us(lambda: select_samples(page, _NAMES), args.repeat)
    prefiltered = _best_us(lambda: list(text_string_to_metric_families(wanted_lines)), args.repeat)
    full = _best_us(lambda: _full_parse(page), max(1, args.repeat // 20))
    print(f"page: {len(page.encode()) / 1024:.0f} KiB, {page.count(chr(10))} lines, {args.engines} engines, "
          f"{wanted_lines.count(chr(10))} wanted samples")
    print(f"kvgate parse_vllm_metrics:                    {ours:9.1f} us")
    print(f"  of which select_samples (find + parse):     {selection_only:9.1f} us")
    print(f"prometheus_client on the wanted lines only:   {prefiltered:9.1f} us  (parse alone, lines pre-cut)")
    print(f"prometheus_client full parse:                 {full:9.1f} us")
    print(f"speed-up over the full parse:                 {full / ours:9.1f} x")


if __name__ == "__main__":
    main()
