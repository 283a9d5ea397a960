"""Reads a few metric families out of a Prometheus text page without parsing the rest of it.

A vLLM page is 50-200 KB of histograms; routing needs a handful of gauges. One regular-expression
pass finds their sample lines and a line pattern parses just those. prometheus_client's parser walks
label strings character by character in Python: about 20 ms for a whole 150 KB page, and still about
0.3 ms for just the 18 wanted lines; this module takes about 0.15 ms for the page, search included
(`kvgate bench scrape-parse`). Tests check it agrees with prometheus_client.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from prometheus_client.samples import Sample

_LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*+"
_ESCAPED_TEXT = r'[^"\\]*+(?:\\.[^"\\]*+)*+'  # up to the closing quote, with \\ \" \n escapes inside
_LABEL = re.compile(rf'({_LABEL_NAME})="({_ESCAPED_TEXT})"')
_SAMPLE = re.compile(  # name, optional {labels}, value, optional integer timestamp in ms
    rf'([a-zA-Z_:][a-zA-Z0-9_:]*+)(?:\{{((?:{_LABEL_NAME}="{_ESCAPED_TEXT}",?)*+)\}})?'
    r"[ \t]++(\S++)(?:[ \t]++-?[0-9]++)?[ \t]*+"
)
_ESCAPE = re.compile(r'\\([\\n"])')


def select_samples(page: str, names: Iterable[str]) -> list[Sample]:
    """The samples of `page` whose metric name is exactly one of `names`, in page order.

    Raises ValueError when one of those sample lines is malformed; other lines are never looked at.
    """
    text = "\n" + page  # every sample line, the first included, now follows a newline
    return [_parse_sample(match.group(1)) for match in _lines_of(tuple(names)).finditer(text)]


@functools.lru_cache(maxsize=16)
def _lines_of(names: tuple[str, ...]) -> re.Pattern[str]:
    """A pattern for whole sample lines of these metrics; HELP/TYPE lines start with '#' and never match."""
    alternatives = "|".join(re.escape(name) for name in names)
    return re.compile(rf"\n((?:{alternatives})[{{ \t][^\n]*)")


def _parse_sample(line: str) -> Sample:
    match = _SAMPLE.fullmatch(line.rstrip("\r"))
    if match is None:
        raise ValueError(f"malformed sample line: {line[:200]!r}")
    name, labels, value = match.groups()
    return Sample(name, _parse_labels(labels) if labels else {}, float(value))


def _parse_labels(labels: str) -> dict[str, str]:
    return {key: _ESCAPE.sub(_unescape, value) if "\\" in value else value
            for key, value in _LABEL.findall(labels)}


def _unescape(match: re.Match[str]) -> str:
    return "\n" if match.group(1) == "n" else match.group(1)
