"""The asyncio shell around EngineCore: one task per replica sleeps once per step for the whole batch."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from kvgate.simulator.kv_publisher import KvEventPublisher
from kvgate.simulator.metrics import EngineMetrics
from kvgate.simulator.options import SimOptions
from kvgate.simulator.scheduler import EngineCore, EngineTotals, FinishReason, Sequence

log = logging.getLogger(__name__)


class Generation:
    """The sequences of one API request and the event that wakes its handler when any of them advances."""

    __slots__ = ("changed", "seqs")

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        self.changed = asyncio.Event()

    @property
    def done(self) -> bool:
        """Whether every sequence has finished."""
        return all(seq.finished for seq in self.seqs)

    @property
    def aborted(self) -> bool:
        """Whether the engine dropped any sequence before it completed."""
        return any(seq.finish_reason is FinishReason.ABORT for seq in self.seqs)

    async def wait_done(self) -> None:
        """Wait until every sequence has finished."""
        while not self.done:
            await self.changed.wait()
            self.changed.clear()


class AsyncEngine:
    """Runs an EngineCore in real time and connects its sequences to the HTTP handlers waiting on them."""

    def __init__(self, options: SimOptions, metrics: EngineMetrics) -> None:
        self._options = options
        self._metrics = metrics
        self.core = EngineCore(options)
        self._owners: dict[Sequence, Generation] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._baseline = EngineTotals()
        self._baseline_evictions = 0
        self.publisher: KvEventPublisher | None = None  # set when the replica publishes KV events
        metrics.publish(self.core)

    def start(self) -> None:
        """Start the engine loop on the running event loop."""
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Abort everything still in flight and stop the engine loop."""
        self.abort_all()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def submit(self, seqs: list[Sequence]) -> Generation:
        """Queue the sequences of one request."""
        generation = Generation(seqs)
        for seq in generation.seqs:
            self.core.add(seq)
            self._owners[seq] = generation
        self._wake.set()  # the gauges show it after the next step, as vLLM's do
        return generation

    def abort(self, generation: Generation) -> None:
        """Abort a request's unfinished sequences at once, freeing their KV blocks."""
        now = asyncio.get_running_loop().time()
        for seq in generation.seqs:
            if self.core.abort(seq):
                del self._owners[seq]
                self._metrics.observe_finished(seq, now)
        self._metrics.publish(self.core)
        generation.changed.set()
        self._wake.set()  # freed blocks may let waiting sequences in

    def abort_all(self) -> None:
        """Abort every request in flight (engine shutdown)."""
        for generation in set(self._owners.values()):
            self.abort(generation)

    def stats(self) -> dict[str, int | float]:
        """Exact counters since the last reset, and the current queue and cache state."""
        totals, base = self.core.totals, self._baseline
        counters = {
            field.name: getattr(totals, field.name) - getattr(base, field.name) for field in dataclasses.fields(totals)
        }
        cache = self.core.cache
        return counters | {
            "running": len(self.core.running),
            "waiting": self.core.num_waiting,
            "kv_cache_usage": cache.pinned_blocks / cache.num_blocks,
            "cached_blocks": cache.cached_blocks,
            "evictions": cache.evictions - self._baseline_evictions,
        }

    def reset(self) -> None:
        """Zero the /sim/stats counters and drop the unpinned prefix cache (Prometheus counters stay monotonic)."""
        self._baseline = dataclasses.replace(self.core.totals)
        self._baseline_evictions = self.core.cache.evictions
        self.core.reset_prefix_cache()
        self._publish_events()

    async def restart(self) -> None:
        """Lose every request and cached block; a new publisher starts its sequence again, as a restarted engine."""
        self.abort_all()
        self.core.reset_prefix_cache()
        self.core.drain_events()  # a restarted engine says nothing about the cache it lost
        if self.publisher is not None:
            await self.publisher.restart()

    def _publish_events(self) -> None:
        events = self.core.drain_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    @property
    def dead(self) -> bool:
        """Whether the engine loop has crashed (vLLM then answers /health with 503)."""
        return self._task is not None and self._task.done()

    async def _run(self) -> None:
        try:
            await self._step_forever()
        except Exception:
            log.exception("sim engine loop crashed; aborting in-flight requests")
            self.abort_all()
            raise

    async def _step_forever(self) -> None:
        loop = asyncio.get_running_loop()
        core, metrics = self.core, self._metrics
        step_start = loop.time()
        while True:
            step = core.schedule()
            self._publish_events()
            metrics.publish(core)
            if not core.running:
                self._wake.clear()
                await self._wake.wait()
                step_start = loop.time()
                continue
            # Sleep until the step's end measured from the previous step's end, so the time handlers
            # spend streaming overlaps the simulated GPU work instead of adding to it.
            duration = self._options.scaled(core.step_seconds(step))
            await asyncio.sleep(max(0.0, step_start + duration - loop.time()))
            now = step_start = loop.time()
            outcome = core.complete_step(now)
            metrics.observe_step(outcome, now, step.num_tokens)
            for seq in outcome.advanced:
                self._owners[seq].changed.set()
            for seq in outcome.finished:
                del self._owners[seq]
