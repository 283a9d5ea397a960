"""The processes of one run: a simulated fleet and a kvgate gateway in front of it, and the gateway's counters."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvgate.loadtest.bench.gateway_probe import metric_samples
from kvgate.loadtest.bench.processes import HOST, ChildProcess, base_url, free_ports, start_sim_fleet
from kvgate.simulator import SimOptions

_GATEWAY_ARGV = [sys.executable, "-m", "kvgate.router.cli", "serve", "--drain-delay", "0", "--drain-timeout", "2",
                 "--log-level", "warning"]
_ADMISSION_METRICS = ("kvgate_admission_dispatched", "kvgate_admission_shed", "kvgate_admission_wait_seconds",
                      "kvgate_admission_preempted")
_COUNTED_SUFFIXES = ("_total", "_sum", "_count")


@dataclass(frozen=True, slots=True)
class Services:
    """Where a run sends its load, and the replicas behind it."""

    gateway_url: str
    replica_urls: list[str]


async def start_gateway(name: str, endpoints: Sequence[str], flags: Sequence[str],
                        log_dir: Path) -> tuple[ChildProcess, str]:
    """`kvgate serve` in front of `endpoints` with extra `flags`; returns the process and its URL once ready."""
    (port,) = free_ports(1)
    argv = [*_GATEWAY_ARGV, "--listen", f"{HOST}:{port}", "--endpoints", ",".join(endpoints), *flags]
    child = ChildProcess(name, argv, log_dir / f"{name}.log")
    url = base_url(port)
    try:
        await child.start()
        await child.wait_ready([url + "/readyz"])
    except BaseException:
        await child.stop()
        raise
    return child, url


@asynccontextmanager
async def fleet(name: str, replicas: int, options: SimOptions, log_dir: Path) -> AsyncIterator[list[str]]:
    """A `kvgate sim` fleet for the duration of the block; yields the replica URLs."""
    child, urls = await start_sim_fleet(name, replicas, options, log_dir)
    try:
        yield urls
    finally:
        await child.stop()


@asynccontextmanager
async def gateway(name: str, endpoints: Sequence[str], flags: Sequence[str], log_dir: Path) -> AsyncIterator[str]:
    """A kvgate gateway for the duration of the block; yields its URL."""
    child, url = await start_gateway(name, endpoints, flags, log_dir)
    try:
        yield url
    finally:
        await child.stop()


@asynccontextmanager
async def services(name: str, replicas: int, options: SimOptions, flags: Sequence[str],
                   log_dir: Path) -> AsyncIterator[Services]:
    """A fresh fleet and a gateway in front of it."""
    async with fleet(f"{name}-sim", replicas, options, log_dir) as urls:
        async with gateway(f"{name}-kvgate", urls, flags, log_dir) as url:
            yield Services(url, urls)


async def admission_counters(gateway_url: str) -> dict[str, float]:
    """The gateway's admission counters (dispatched, shed, preempted, wait sum and count) keyed by name and labels."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        samples = await metric_samples(session, gateway_url, _ADMISSION_METRICS)
    counters: dict[str, float] = {}
    for sample in samples:
        if sample.name.endswith(_COUNTED_SUFFIXES):
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            counters[f"{sample.name.removeprefix('kvgate_admission_')}{{{labels}}}"] = sample.value
    return counters
