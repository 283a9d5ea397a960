"""What the soak saw: kvgate's memory, descriptors and CPU over time, what they say, its Markdown and plot."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import psutil

from kvgate.loadtest.kit.report import table

matplotlib.use("Agg")  # headless: the plot goes to a file
import matplotlib.pyplot as plt  # noqa: E402

# Memory counts as flat when, after warm-up, it grows slower than this and ends within this factor of its level then.
FLAT_SLOPE_MB_PER_MIN = 1.0
FLAT_GROWTH = 1.2


def plot(report: dict[str, Any], path: Path) -> None:
    """RSS and open descriptors against time, the end of the load and each replica kill marked."""
    samples = report["samples"]
    times = [s["t"] for s in samples]
    figure, (rss_axis, fd_axis) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    rss_axis.plot(times, [s["rss_mb"] for s in samples], color="tab:blue")
    rss_axis.set_ylabel("kvgate RSS (MiB)")
    rss_axis.set_ylim(bottom=0)
    fd_axis.plot(times, [s["fds"] for s in samples], color="tab:green")
    fd_axis.set_ylabel("kvgate open fds")
    fd_axis.set_xlabel("seconds since the load began")
    for axis in (rss_axis, fd_axis):
        for event in report["events"]:
            if event["event"] == "kill":
                axis.axvline(event["t"], color="tab:red", alpha=0.3, linewidth=1)
        axis.axvline(report["memory"]["warmup_end_s"], color="gray", linestyle=":", linewidth=1)
        axis.axvline(report["load_end_s"], color="black", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
    rss_axis.set_title("kvgate soak: red = replica killed, dotted = warm-up end, dashed = load end")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _outcome_rows(report: dict[str, Any]) -> list[str]:
    return table(("client kind", "requests", "outcomes"), [
        (kind, stats["started"], ", ".join(f"{name} {count}" for name, count in stats["outcomes"].items()))
        for kind, stats in report["by_kind"].items()])


def _counter_line(counters: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.0f}" for key, value in sorted(counters.items())) or "none"


def verdict(report: dict[str, Any]) -> str:
    """Whether memory stayed flat after warm-up, in one sentence."""
    memory = report["memory"]
    flat = "flat" if memory["flat"] else "NOT flat"
    return (f"Memory is {flat}: after warm-up RSS changed by {memory['slope_mb_per_min']:+.2f} MiB/min "
            f"(limit < {FLAT_SLOPE_MB_PER_MIN:g}) and ended the load at {memory['end_of_load_mb']:.1f} MiB, "
            f"{memory['end_of_load_mb'] / memory['at_warmup_end_mb']:.2f}x its {memory['at_warmup_end_mb']:.1f} MiB "
            f"at warm-up end (limit {FLAT_GROWTH:g}x).")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: setup, memory and descriptors, outcomes by client kind, gateway counters."""
    meta, plan, memory, fds, cpu = report["meta"], report["plan"], report["memory"], report["fds"], report["cpu"]
    shape, sim = plan["shape"], plan["sim"]
    kills = sum(1 for event in report["events"] if event["event"] == "kill")
    gateway = report["gateway"]
    lines = [
        "### Soak: memory and descriptors under long streaming load with faults",
        "",
        f"Measured {meta['date']} by `{meta['command']}` on {meta['cpus']} CPUs shared by kvgate, the simulated "
        f"replicas and the load generator (1-minute load average before/after: {meta['loadavg_1m'][0]}/"
        f"{meta['loadavg_1m'][1]}). kvgate (default settings) ran in front of {plan['replicas']} `kvgate sim` "
        f"replicas, each its own process (max_num_seqs {sim['max_num_seqs']}, decode step "
        f"{sim['decode_step_seconds']} s). For {plan['minutes']:g} min, {shape['concurrency']} clients streamed "
        f"chat completions of {shape['max_tokens']} tokens back to back (pause up to {shape['think_s']:g} s; "
        f"{report['requests']} requests in all, {report['requests_per_s']} req/s). Every "
        f"{shape['fault_interval_s']:g} s: {shape['aborts_per_round']} clients disconnected after the first event, "
        f"{shape['slow_readers_per_round']} read a {shape['slow_reader_max_tokens']}-token stream "
        f"{shape['slow_read_bytes']} B per {shape['slow_read_interval_s']:g} s through a 4 KiB receive buffer, and "
        f"one of each malformed request was sent. Every {plan['kill_interval_s']:g} s a replica was killed "
        f"(SIGKILL; {kills} kills) and restarted on its port {plan['replica_down_s']:g} s later. kvgate's RSS, "
        f"open descriptors and CPU were sampled every {plan['sample_interval_s']:g} s; warm-up is the first "
        f"{plan['warmup_s']:g} s.",
        "",
        "| | first | min | max | at warm-up end | end of load | after settling | slope after warm-up |",
        "|---|---|---|---|---|---|---|---|",
        f"| RSS (MiB) | {memory['first_mb']:.1f} | {memory['min_mb']:.1f} | {memory['max_mb']:.1f} "
        f"| {memory['at_warmup_end_mb']:.1f} | {memory['end_of_load_mb']:.1f} | {memory['last_mb']:.1f} "
        f"| {memory['slope_mb_per_min']:+.2f} MiB/min |",
        f"| open fds | {fds['before_load']} | {fds['min']} | {fds['max']} | | {fds['end_of_load']} "
        f"| {fds['after_settle']} ({plan['settle_s']:g} s after) | |",
        "",
        f"{verdict(report)} Descriptors: kvgate keeps idle upstream connections pooled for 30 s and closes them "
        f"on the pool's next cleanup, 30 to 60 s after their last use, so they return to the level before the "
        f"load only once that has passed. kvgate's CPU under load: mean {cpu['mean']:.0%} of a core, highest sample "
        f"{cpu['max']:.0%}. Lost requests (no answer, a truncated stream, or a timeout): {report['lost']}. "
        f"Tracebacks in kvgate's log: {report['tracebacks']}.",
        "",
        *_outcome_rows(report),
        "",
        "Outcomes: `ok` a complete answer; `error_event` a stream kvgate ended with an OpenAI error event and "
        "`[DONE]` (its replica was killed mid-stream); `http_NNN` an error answer; `aborted` the client left on "
        "purpose; `rejected_4xx` a malformed request refused. "
        f"kvgate's counters: upstream errors by kind: {_counter_line(gateway.get('upstream_errors', {}))}; "
        f"retries by cause: {_counter_line(gateway.get('retries', {}))}; requests it refused by reason: "
        f"{_counter_line(gateway.get('rejected_requests', {}))}; in flight after the run: "
        f"{_counter_line(gateway.get('requests_in_flight', {}))}.",
        "",
        f"Plot of RSS and descriptors over time: `{meta['plot']}` (written by each run, not kept in git).",
    ]
    return "\n".join(lines) + "\n"


class ProcessSampler:
    """Readings of one process: resident memory, open descriptors, and CPU (share of one core) since the last one."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self._start = self._last_wall = time.monotonic()
        self._last_cpu = self._cpu_seconds()
        self.samples: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        """Seconds since the sampler was made, to a hundredth."""
        return round(time.monotonic() - self._start, 2)

    def read(self) -> dict[str, Any]:
        """One reading now: `t` (seconds since the sampler was made), `rss_mb`, `fds` and `cpu`."""
        now, cpu_seconds = time.monotonic(), self._cpu_seconds()
        busy = (cpu_seconds - self._last_cpu) / (now - self._last_wall) if now > self._last_wall else 0.0
        self._last_wall, self._last_cpu = now, cpu_seconds
        with self._process.oneshot():
            return {"t": round(now - self._start, 2), "rss_mb": round(self._process.memory_info().rss / 2**20, 2),
                    "fds": self._process.num_fds(), "cpu": round(busy, 3)}

    async def record(self) -> None:
        """Keep one reading in `samples` (none once the process has exited)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.samples.append(self.read())

    def _cpu_seconds(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system


def after_warmup(samples: Sequence[dict[str, Any]], warmup_s: float, load_end_s: float) -> list[dict[str, Any]]:
    """The samples taken under load once warm-up was over (the later half of the load when too few remain)."""
    loaded = [s for s in samples if s["t"] <= load_end_s]
    steady = [s for s in loaded if s["t"] >= warmup_s]
    return steady if len(steady) >= 3 else loaded[len(loaded) // 2:]


def memory_summary(samples: Sequence[dict[str, Any]], warmup_s: float, load_end_s: float) -> dict[str, Any]:
    """RSS first/min/max/last, its level at warm-up end, its least-squares slope after warm-up, and the verdict."""
    rss = [s["rss_mb"] for s in samples]
    steady = after_warmup(samples, warmup_s, load_end_s)
    slope = statistics.linear_regression([s["t"] / 60 for s in steady], [s["rss_mb"] for s in steady]).slope \
        if len(steady) >= 2 and steady[-1]["t"] > steady[0]["t"] else 0.0
    at_warmup = steady[0]["rss_mb"] if steady else rss[0]
    end_of_load = steady[-1]["rss_mb"] if steady else rss[-1]
    return {"first_mb": rss[0], "min_mb": min(rss), "max_mb": max(rss), "last_mb": rss[-1],
            "warmup_end_s": steady[0]["t"] if steady else 0.0, "at_warmup_end_mb": at_warmup,
            "end_of_load_mb": end_of_load, "slope_mb_per_min": round(slope, 3),
            "flat": slope < FLAT_SLOPE_MB_PER_MIN and end_of_load <= FLAT_GROWTH * at_warmup}


def fd_summary(samples: Sequence[dict[str, Any]], before_load: int, load_end_s: float) -> dict[str, Any]:
    """Open descriptors before the load, their range under it, at its end, and after the settling time."""
    loaded = [s["fds"] for s in samples if s["t"] <= load_end_s]
    return {"before_load": before_load, "min": min(loaded), "max": max(loaded), "end_of_load": loaded[-1],
            "after_settle": samples[-1]["fds"]}


def cpu_summary(samples: Sequence[dict[str, Any]], load_end_s: float) -> dict[str, float]:
    """kvgate's CPU (share of one core) under the load: mean and highest sample."""
    loaded = [s["cpu"] for s in samples[1:] if s["t"] <= load_end_s] or [0.0]
    return {"mean": round(statistics.fmean(loaded), 3), "max": max(loaded)}
