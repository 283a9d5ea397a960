"""PNG plots of a scenario: TTFT distribution per row, and each replica's load over time per row."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers or in CI

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from kvgate.loadtest.routing.report import RowRun, ScenarioRun  # noqa: E402

_GRID_COLUMNS = 3


def plot_ttft_cdf(scenario: ScenarioRun, path: Path) -> Path:
    """One CDF line of time to first token per row."""
    figure, axes = plt.subplots(figsize=(8, 5))
    for row in _first_runs(scenario):
        ttfts = sorted(sample.ttft * 1000 for sample in row.samples if sample.error is None and sample.ttft is not None)
        if ttfts:
            fractions = [(index + 1) / len(ttfts) for index in range(len(ttfts))]
            axes.step(ttfts, fractions, where="post", label=row.plan.name)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (ms, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(f"TTFT distribution: {scenario.name}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    return _save(figure, path)


def plot_replica_load(scenario: ScenarioRun, path: Path) -> Path:
    """A panel per row with each replica's running + waiting requests over the run."""
    rows = [row for row in _first_runs(scenario) if row.load.times]
    columns = min(_GRID_COLUMNS, max(1, len(rows)))
    grid_rows = max(1, math.ceil(len(rows) / columns))
    figure, panels = plt.subplots(grid_rows, columns, figsize=(5 * columns, 3.2 * grid_rows), squeeze=False,
                                  sharey=True)
    for panel, row in zip(panels.flat, rows, strict=False):
        for replica, load in enumerate(row.load.per_replica):
            panel.plot(row.load.times, load, label=f"replica {replica}")
        panel.set_title(row.plan.name)
        panel.set_xlabel("seconds")
        panel.grid(True, alpha=0.3)
    for panel in panels[:, 0]:
        panel.set_ylabel("running + waiting")
    for panel in list(panels.flat)[len(rows):]:
        panel.set_visible(False)
    if rows:
        panels.flat[0].legend(loc="upper right", fontsize="small")
    figure.suptitle(f"Per-replica load: {scenario.name}")
    return _save(figure, path)


def _first_runs(scenario: ScenarioRun) -> list[RowRun]:
    """Each row's first run: the plots show one run of every row."""
    seen: dict[str, RowRun] = {}
    for row in scenario.rows:
        seen.setdefault(row.plan.name, row)
    return list(seen.values())


def _save(figure: plt.Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
