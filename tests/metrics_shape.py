"""The shape of a vLLM /metrics page: each vllm: family's type and label names, values left out."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REAL_PAGE = Path(__file__).parent / "fixtures" / "vllm-0.32.0-metrics.txt"  # captured from a busy vLLM 0.32.0


def vllm_family_shapes(page: str) -> dict[str, tuple[str, frozenset[str]]]:
    """vllm: family name -> (type, label names), as prometheus_client's parser reads the page."""
    shapes = {}
    for family in text_string_to_metric_families(page):
        if family.name.startswith("vllm:"):
            labels = frozenset(name for sample in family.samples for name in sample.labels if name != "le")
            shapes[family.name] = (family.type, labels)
    return shapes
