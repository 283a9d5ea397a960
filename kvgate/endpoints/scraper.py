"""Polls every replica's vLLM `/metrics` page and keeps the latest ReplicaMetrics of each."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import aiohttp

from kvgate.endpoints.types import UNSCRAPED, Endpoint, ReplicaMetrics
from kvgate.endpoints.polling import OutageLog, fetch_body, is_current, voided_keys
from kvgate.endpoints.vllm_metrics import parse_vllm_metrics

log = logging.getLogger(__name__)

ResultListener = Callable[[str, bool, float], None]  # (endpoint key, scrape succeeded, duration in seconds)
RoundListener = Callable[[], None]
StartListener = Callable[[str], None]  # (endpoint key)


class MetricsScraper:
    """Scrapes each endpoint in its own loop, once per interval; a slow or dead replica only delays itself.

    A busy vLLM engine takes from a few to several hundred milliseconds to render its ~55 KB page, so a scrape
    may take longer than the interval: that replica is then scraped as often as its page allows, and its last
    metrics stay fresh while each scrape finishes within the timeout.
    """

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],  # the gateway's, open while it runs
        interval_s: float = 0.2,
        timeout_s: float | None = None,
        stale_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        timeout_s = 0.75 * interval_s if timeout_s is None else timeout_s
        # Fresh while the next scrape may still be under way: a success at most one interval plus a timeout ago.
        stale_after_s = max(3 * interval_s, interval_s + timeout_s) if stale_after_s is None else stale_after_s
        if interval_s <= 0 or stale_after_s <= 0 or timeout_s <= 0:
            raise ValueError("scrape interval, timeout and staleness age must be positive")
        self._session = session
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._endpoints: dict[str, Endpoint] = {}
        self._metrics: dict[str, ReplicaMetrics] = {}
        self._outages = OutageLog(log, "metrics scrape")
        self._result_listeners: list[ResultListener] = []
        self._round_listeners: list[RoundListener] = []
        self._start_listeners: list[StartListener] = []

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Scrape exactly these endpoints from the next round on; forget the metrics of the ones gone."""
        new = {e.key: e for e in endpoints}
        for key in voided_keys(self._endpoints, new):
            self._metrics.pop(key, None)
            self._outages.forget(key)
        self._endpoints = new

    def metrics(self, key: str) -> ReplicaMetrics:
        """The endpoint's latest metrics, marked stale when the last success is older than the staleness age."""
        metrics = self._metrics.get(key, UNSCRAPED)
        if not metrics.stale and metrics.scraped_at is not None \
                and self._clock() - metrics.scraped_at > self._stale_after_s:
            return dataclasses.replace(metrics, stale=True)
        return metrics

    def add_result_listener(self, listener: ResultListener) -> None:
        """Call `listener(key, ok, duration_s)` after every scrape of every endpoint (gateway metrics)."""
        self._result_listeners.append(listener)

    def add_start_listener(self, listener: StartListener) -> None:
        """Call `listener(key)` as every scrape of every endpoint starts (to tell what its page may include)."""
        self._start_listeners.append(listener)

    def add_round_listener(self, listener: RoundListener) -> None:
        """Call `listener()` after every scrape of any endpoint has been recorded (the fleet's view moved)."""
        self._round_listeners.append(listener)

    async def run(self) -> None:
        """Keep one scrape loop per current endpoint until cancelled."""
        loops: dict[str, tuple[Endpoint, asyncio.Task]] = {}
        try:
            while True:
                for key, (endpoint, task) in list(loops.items()):
                    if task.done() or not is_current(self._endpoints, endpoint):
                        task.cancel()
                        del loops[key]
                for key, endpoint in self._endpoints.items():
                    if key not in loops:
                        loops[key] = (endpoint, asyncio.create_task(self._scrape_loop(endpoint)))
                await asyncio.sleep(self._interval_s)
        finally:
            for _, task in loops.values():
                task.cancel()
            await asyncio.gather(*(task for _, task in loops.values()), return_exceptions=True)

    async def _scrape_loop(self, endpoint: Endpoint) -> None:
        """Scrape one endpoint every interval (or back to back while its page is slower) while it is current."""
        loop = asyncio.get_running_loop()
        while is_current(self._endpoints, endpoint):
            started = loop.time()
            await self._scrape(endpoint)
            self._round_done()
            await asyncio.sleep(max(0.0, started + self._interval_s - loop.time()))

    async def scrape_once(self) -> None:
        """One round: scrape all current endpoints concurrently, each bounded by the timeout."""
        await asyncio.gather(*(self._scrape(e) for e in list(self._endpoints.values())))
        self._round_done()

    def _round_done(self) -> None:
        for listener in self._round_listeners:
            _notify(listener)

    async def _scrape(self, endpoint: Endpoint) -> None:
        for listener in self._start_listeners:
            _notify(listener, endpoint.key)
        started = time.perf_counter()
        try:
            page = await fetch_body(self._session(), endpoint.url + "/metrics", self._timeout_s)
            outcome: ReplicaMetrics | Exception = parse_vllm_metrics(page.decode("utf-8", "replace"),
                                                                     scraped_at=self._clock())
        except Exception as exc:  # whatever one replica does must not stop the round
            outcome = exc
        self._record(endpoint, outcome, time.perf_counter() - started)

    def _record(self, endpoint: Endpoint, outcome: ReplicaMetrics | Exception, duration_s: float) -> None:
        """Store a scrape's outcome: fresh metrics, or the previous ones marked stale."""
        if not is_current(self._endpoints, endpoint):
            return  # removed or replaced while the scrape was in flight
        key = endpoint.key
        if isinstance(outcome, Exception):
            self._outages.failed(key, outcome)
            self._metrics[key] = dataclasses.replace(self._metrics.get(key, UNSCRAPED), stale=True)
        else:
            self._outages.succeeded(key)
            self._metrics[key] = outcome
        for listener in self._result_listeners:
            _notify(listener, key, isinstance(outcome, ReplicaMetrics), duration_s)


def _notify(listener: Callable[..., None], *args: object) -> None:
    """Run a listener; a bug in one must not stop scraping."""
    try:
        listener(*args)
    except Exception:
        log.exception("scrape listener failed listener=%r", listener)
