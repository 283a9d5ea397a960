"""`kvgate bench scrape-parse`: kvgate's parse of a ~150 KB vLLM /metrics page against prometheus_client's."""

from __future__ import annotations

import argparse

from prometheus_client.parser import text_string_to_metric_families

from kvgate.endpoints.prometheus_text import select_samples
from kvgate.endpoints.vllm_metrics import parse_vllm_metrics
from kvgate.loadtest.kit.report import RunMeta, publish, table
from kvgate.loadtest.kit.stats import best_microseconds
from kvgate.loadtest.kit.vllm_metrics_page import EngineLoad, LoraSeries, render_vllm_metrics

_NAMES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:cache_config_info", "vllm:lora_requests_info")


def _full_parse(page: str) -> int:
    """What a scraper that parses every family does: every sample of the page, then pick the wanted ones."""
    return sum(1 for family in text_string_to_metric_families(page) for sample in family.samples
               if sample.name in _NAMES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The page's size and how many parses each timing takes."""
    parser.add_argument("--engines", type=int, default=4, help="data-parallel engines on the page (4 -> ~150 KB)")
    parser.add_argument("--repeat", type=int, default=200, help="parses per timing sample (--quick: 20)")


def run(options: argparse.Namespace) -> int:
    """Time each approach on the same page; write scrape-parse.{json,md}."""
    meta = RunMeta()
    repeat = 20 if options.quick else options.repeat
    engines = [EngineLoad(running=3, waiting=1, kv_cache_usage=0.4, num_gpu_blocks=4096)] * options.engines
    page = render_vllm_metrics(engines, lora=[LoraSeries(1.7e9, ("sql-lora",)), LoraSeries(1.6e9)])
    if _full_parse(page) != len(select_samples(page, _NAMES)):
        raise RuntimeError("kvgate's parser and prometheus_client's see different samples")
    wanted_lines = "\n".join(line for line in page.splitlines() if line.startswith(_NAMES)) + "\n"
    ours = best_microseconds(lambda: parse_vllm_metrics(page, scraped_at=0.0), repeat, 5)
    timings = [
        ("kvgate parse_vllm_metrics", ours),
        ("of which select_samples (find + parse)", best_microseconds(lambda: select_samples(page, _NAMES), repeat, 5)),
        ("prometheus_client on the wanted lines only (parse alone, lines pre-cut)",
         best_microseconds(lambda: list(text_string_to_metric_families(wanted_lines)), repeat, 5)),
        ("prometheus_client full parse", best_microseconds(lambda: _full_parse(page), max(1, repeat // 20), 5)),
    ]
    report = meta.finish(command=options.command, page_kib=round(len(page.encode()) / 1024), lines=page.count("\n"),
                         engines=options.engines, wanted_samples=wanted_lines.count("\n"),
                         microseconds=dict(timings), speed_up=round(timings[-1][1] / ours, 1))
    markdown = (f"Measured {report['date']} by `{options.command}`: a {report['page_kib']} KiB page, {report['lines']} "
                f"lines, {options.engines} engines, {report['wanted_samples']} wanted samples; best of 5.\n\n"
                + "\n".join(table(("parse", "us per page"), [(name, f"{us:.1f}") for name, us in timings]))
                + f"\n\nSpeed-up over the full parse: {report['speed_up']}x.\n")
    publish(options.out, "scrape-parse", report, markdown, options.docs)
    return 0
