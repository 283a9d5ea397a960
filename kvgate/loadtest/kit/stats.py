"""The one percentile every benchmark reports, and the spread of a figure over repeated runs."""

from __future__ import annotations

import math
import statistics
import timeit
from collections.abc import Callable, Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, interpolating linearly between ranks; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float | None]) -> tuple[float, float, float] | None:
    """(median, lowest, highest) of one figure over repeated runs, runs without it left out; None if none has it."""
    measured = [value for value in values if value is not None]
    if not measured:
        return None
    return statistics.median(measured), min(measured), max(measured)


def best_microseconds(call: Callable[[], object], number: int, repeat: int) -> float:
    """The best per-call time of `call` over `repeat` timings of `number` calls each, in microseconds."""
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def ms(seconds: Iterable[float], q: float, digits: int = 1) -> float:
    """The q-th percentile of times in seconds, in milliseconds rounded to `digits`; 0 for no values."""
    return round((percentile(seconds, q) or 0.0) * 1000, digits)
