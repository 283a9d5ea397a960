"""What the soak's resource samples say: memory over time and its trend after warm-up, descriptors, CPU."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvgate.loadtest.soak.sampler import ResourceSample

# Memory counts as flat when, after warm-up, it grows slower than this and ends within this factor of its level then.
FLAT_SLOPE_MB_PER_MIN = 1.0
FLAT_GROWTH = 1.2


def after_warmup(samples: Sequence[ResourceSample], warmup_s: float, load_end_s: float) -> list[ResourceSample]:
    """The samples taken under load once warm-up was over (the later half of the load when too few remain)."""
    loaded = [s for s in samples if s.t <= load_end_s]
    steady = [s for s in loaded if s.t >= warmup_s]
    return steady if len(steady) >= 3 else loaded[len(loaded) // 2:]


def memory_summary(samples: Sequence[ResourceSample], warmup_s: float, load_end_s: float) -> dict[str, Any]:
    """RSS first/min/max/last, its level at warm-up end, its least-squares slope after warm-up, and the verdict."""
    rss = [s.rss_mb for s in samples]
    steady = after_warmup(samples, warmup_s, load_end_s)
    slope = statistics.linear_regression([s.t / 60 for s in steady], [s.rss_mb for s in steady]).slope \
        if len(steady) >= 2 and steady[-1].t > steady[0].t else 0.0
    at_warmup = steady[0].rss_mb if steady else rss[0]
    end_of_load = steady[-1].rss_mb if steady else rss[-1]
    return {"first_mb": rss[0], "min_mb": min(rss), "max_mb": max(rss), "last_mb": rss[-1],
            "warmup_end_s": steady[0].t if steady else 0.0, "at_warmup_end_mb": at_warmup,
            "end_of_load_mb": end_of_load, "slope_mb_per_min": round(slope, 3),
            "flat": slope < FLAT_SLOPE_MB_PER_MIN and end_of_load <= FLAT_GROWTH * at_warmup}


def fd_summary(samples: Sequence[ResourceSample], baseline: ResourceSample, load_end_s: float) -> dict[str, Any]:
    """Open descriptors before the load, their range under it, at its end, and after the settling time."""
    loaded = [s.fds for s in samples if s.t <= load_end_s]
    return {"before_load": baseline.fds, "min": min(loaded), "max": max(loaded), "end_of_load": loaded[-1],
            "after_settle": samples[-1].fds}


def cpu_summary(samples: Sequence[ResourceSample], load_end_s: float) -> dict[str, float]:
    """kvgate's CPU (share of one core) under the load: mean and highest sample."""
    loaded = [s.cpu for s in samples[1:] if s.t <= load_end_s] or [0.0]
    return {"mean": round(statistics.fmean(loaded), 3), "max": max(loaded)}
