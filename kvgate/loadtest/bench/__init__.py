"""The routing benchmark: a simulated fleet, kvgate under each policy, an oracle, and a report.

`main` and `add_bench_arguments` load lazily, so the locustfile can import `kvgate.loadtest.bench.workload`
without pulling in aiohttp or matplotlib.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_bench_arguments", "main", "run_from_args"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvgate.loadtest.bench import cli

        return getattr(cli, name)
    raise AttributeError(f"module 'kvgate.loadtest.bench' has no attribute {name!r}")
