"""The admission queue: while a model's replicas are saturated, requests wait here by priority class.

Strict priority between classes; within one, FIFO per flow (`x-gateway-inference-fairness-id`) and the flows
served in turn, so one tenant's flood waits behind itself. The queue releases requests as the fleet drains: when a
request finishes and after every metrics scrape it recomputes how many more requests the replicas take before
they are saturated (kvgate.policies.capacity.room_for, which counts what was sent and finished since each
scrape), less those already released but not yet sent. While a more important class has traffic, a class with
a reserve leaves that share of every replica's seats free for it, so an interactive request finds a seat at
once instead of waiting for a batch request to finish, and, where a replica's KV cache size is known, KV blocks
free on one replica for the largest prompt the more important class sent lately. A request of a preemptible class
that can be preempted (router/preemption.py) keeps no seat reserve (it keeps the KV room): when a more important
request finds no free seat, one such request gives up its own and waits here again, at the head of its class. Lower classes get a minimum
share of dispatches so they are never starved; under overflow the newest request of the least important
class is shed first, with 429 and Retry-After.

A class that yields to a more important one waits for throughput, not for its turn: of its next few waiting
requests, the first that a replica with room for it holds the prompt of goes first (`held_with_room`), so that
a prefix a replica caches is not prefilled again wherever room opened first. A request passed over that often
goes next, so none waits more than a few releases longer than its turn.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgate.policies.capacity import ClassStanding
from kvgate.policies.priorities import PriorityConfig
from kvgate.policies.recent_max import RecentMax
from kvgate.policies.types import RequestInfo
from kvgate.router.errors import GatewayError
from kvgate.router.fair_queue import FairQueue
from kvgate.router.metrics import GatewayMetrics
from kvgate.router.preemption import PreemptionRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionConfig:
    """Bounds of the admission queue."""

    max_requests: int = 10_000  # waiting requests, all classes together
    max_bytes: int = 512 * 1024 * 1024  # request bodies held, all classes together
    class_max_requests: Mapping[str, float] = field(default_factory=lambda: {"interactive": 2000.0})
    max_wait: Mapping[str, float] = field(default_factory=lambda: {"interactive": 30.0, "batch": 600.0})
    min_share: float = 0.05  # of dispatches that go to a waiting lower class while higher ones wait
    retry_after_s: int = 2
    reserve: Mapping[str, float] = field(default_factory=lambda: {"batch": 0.1})  # share of seats kept free
    reserve_idle_s: float = 10.0  # a class's reserve is lifted after this long without a more important request
    preemptible: tuple[str, ...] = ("batch",)  # classes whose non-streamed requests may give up their seat
    max_preemptions: int = 3  # times one request may be preempted; after that it keeps its seat
    # requests of a class that yields that may go ahead of its next one because a replica with room holds their
    # prompt; its next one goes once passed over this often (0: strictly in turn)
    lookahead: int = 16


@dataclass(eq=False)
class _Waiter:
    info: RequestInfo
    rank: int  # index of its class, 0 = most important
    enqueued: float
    future: asyncio.Future[None]
    preemptible: bool = False
    passed_over: int = 0  # times a request behind it went first (AdmissionConfig.lookahead)


def _flow(waiter: _Waiter) -> str:
    return waiter.info.flow


def _dispatched(waiter: _Waiter) -> bool:
    return waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None


class AdmissionQueue:
    """Holds requests while their model's fleet is saturated and dispatches them in priority order."""

    def __init__(self, config: AdmissionConfig, priorities: PriorityConfig,
                 room: Callable[[RequestInfo, ClassStanding], float], metrics: GatewayMetrics,
                 preemption: PreemptionRegistry | None = None, clock: Callable[[], float] = time.monotonic,
                 held_with_room: Callable[[RequestInfo, ClassStanding], bool] | None = None,
                 prompt_tokens: Callable[[RequestInfo], int] | None = None) -> None:
        self._config = config
        self._classes = priorities.classes
        self._room = room  # (a request, its class's standing) -> requests like it the fleet takes now
        # (a request, its class's standing) -> whether a replica with room for it holds its prompt
        self._held_with_room = held_with_room
        self._metrics = metrics
        self._preemption = preemption
        self._clock = clock
        self._queues: dict[str, list[FairQueue[_Waiter]]] = {}  # model -> one queue per class
        self._pending: Counter[str] = Counter()  # model -> released from the queue, not yet sent to a replica
        self._since_low: dict[str, int] = {}  # model -> dispatches from a higher class while a lower one waited
        self._last_seen: dict[str, list[float]] = {}  # model -> when a request of each class last arrived
        self._prompt_tokens = prompt_tokens  # a request's prompt length in tokens; None: no KV room kept for classes
        # model -> each class's largest prompt within reserve_idle_s: the KV room the classes below it leave
        self._largest: dict[str, list[RecentMax]] = {}
        self._count = 0
        self._bytes = 0

    def preemptible(self, info: RequestInfo, preemptions: int = 0) -> bool:
        """Whether a request that was preempted `preemptions` times may be preempted again.

        Only a non-streamed request of a preemptible class: a stream answers from its first token on.
        """
        return (self._preemption is not None and not info.stream and info.priority_class in self._config.preemptible
                and preemptions < self._config.max_preemptions)

    async def admit(self, info: RequestInfo, rank: int, preemptions: int = 0) -> ClassStanding:
        """Return when the request (of class `rank`) may go to a replica, with its class's standing then (which
        replicas have room for it depends on it); raise GatewayError(429) when it is shed.

        A request coming back after `preemptions` > 0 preemptions queues at the head of its class, unbounded:
        it was admitted once already.
        """
        model = info.model
        preemptible = self.preemptible(info, preemptions)
        if not preemptions:
            self._seen(info, rank)
        if not self._waiting(model, rank):
            standing = self._standing(model, rank, preemptible)
            if self._has_room(info, standing):
                self._metrics.admitted.labels(info.priority_class, "direct").inc()
                return standing
        waiter = _Waiter(info, rank, self._clock(), asyncio.get_running_loop().create_future(), preemptible)
        self._enqueue(model, waiter, requeued=preemptions > 0)
        self._preempt_for(model)
        max_wait = self._config.max_wait.get(info.priority_class, 60.0)
        try:
            async with asyncio.timeout(max_wait):
                await waiter.future
        except TimeoutError:
            if not _dispatched(waiter):
                self._remove(model, waiter)
                self._shed(info.priority_class, "timeout")
        except asyncio.CancelledError:
            if _dispatched(waiter):
                self._pending[model] -= 1  # released just as the client left: let the next one go
                self._dispatch(model)
            else:
                self._remove(model, waiter)
                self._metrics.queue_abandoned.labels(info.priority_class).inc()
            raise
        self._pending[model] -= 1  # the caller sends it to a replica before it next yields
        self._metrics.queue_wait.labels(info.priority_class).observe(self._clock() - waiter.enqueued)
        self._metrics.admitted.labels(info.priority_class, "queued").inc()
        return self._standing(model, rank, preemptible)

    def release(self, model: str) -> None:
        """A request of `model` finished: its replica may have room again."""
        self._dispatch(model)

    def refresh(self) -> None:
        """The fleet changed (a scrape, discovery): dispatch whatever now fits."""
        for model in list(self._queues):
            self._dispatch(model)

    def describe(self) -> dict[str, object]:
        """Queue depth per model and class, for /debug/fleet."""
        return {
            "waiting": self._count, "bytes": self._bytes,
            "models": {model: {self._classes[rank]: len(queue) for rank, queue in enumerate(queues)}
                       for model, queues in self._queues.items()},
        }

    def _waiting(self, model: str, rank: int | None = None) -> bool:
        """Whether requests of `model` wait: of any class, or of class `rank` and those above it."""
        queues = self._queues.get(model, ())
        return any(queues if rank is None else queues[:rank + 1])

    def _has_room(self, info: RequestInfo, standing: ClassStanding) -> bool:
        """Whether the fleet takes one more request like `info`, of a class so standing, besides those released and
        not yet sent."""
        return self._room(info, standing) - self._pending[info.model] >= 1

    def _seen(self, info: RequestInfo, rank: int) -> None:
        """A request of class `rank` arrived: its class has traffic, and its prompt is one the classes below it leave
        KV room for."""
        now = self._clock()
        self._last_seen.setdefault(info.model, [-math.inf] * len(self._classes))[rank] = now
        if self._prompt_tokens is not None and rank < len(self._classes) - 1:
            largest = self._largest.get(info.model)
            if largest is None:
                largest = self._largest[info.model] = [RecentMax(self._config.reserve_idle_s) for _ in self._classes]
            largest[rank].observe(now, self._prompt_tokens(info))

    def _standing(self, model: str, rank: int, preemptible: bool) -> ClassStanding:
        """Where class `rank` of `model` stands against the other classes now."""
        yields, alone = self._yields(model, rank), self._alone(model, rank)
        # Whether it may preempt matters only to a class that would probe (alone, yielding to none): ask only then,
        # since it walks every replica's preemptible requests.
        return ClassStanding(reserve=self._config.reserve.get(self._classes[rank], 0.0), yields=yields,
                             preemptible=preemptible, alone=alone,
                             may_preempt=alone and not yields and self._may_preempt(model, rank),
                             kv_reserve=self._largest_above(model, rank) if yields else 0)

    def _largest_above(self, model: str, rank: int) -> int:
        """The largest prompt a class more important than `rank` sent within `reserve_idle_s` (0: none)."""
        now = self._clock()
        return max((largest.largest(now) for largest in self._largest.get(model, ())[:rank]), default=0)

    def _may_preempt(self, model: str, rank: int) -> bool:
        """Whether a request of class `rank` could take the seat of a less important one now."""
        return (self._preemption is not None and rank < len(self._classes) - 1
                and self._preemption.has_victims(model, rank))

    def _preempt_for(self, model: str) -> None:
        """Preempt one request for the most important waiting class, unless preemptions under way suffice."""
        if self._preemption is None or not self._waiting(model):
            return
        queues = self._queues[model]
        top = next(rank for rank, queue in enumerate(queues) if queue)
        if self._may_preempt(model, top) and len(queues[top]) > self._preemption.freeing(model):
            self._preemption.preempt(model, top, queues[top].peek().info)

    def _alone(self, model: str, rank: int) -> bool:
        """Whether no class but `rank` sent a request of `model` within `reserve_idle_s`."""
        recent = self._clock() - self._config.reserve_idle_s
        return not any(seen > recent for other, seen in enumerate(self._last_seen.get(model, ())) if other != rank)

    def _yields(self, model: str, rank: int) -> bool:
        """Whether a class more important than `rank` sent a request of `model` within `reserve_idle_s`."""
        recent = self._clock() - self._config.reserve_idle_s
        return any(seen > recent for seen in self._last_seen.get(model, ())[:rank])

    def _enqueue(self, model: str, waiter: _Waiter, requeued: bool) -> None:
        if not requeued:
            self._make_room(model, waiter)  # may empty and drop this model's queues: fetch them after it
        queues = self._queues.setdefault(model, [FairQueue(_flow) for _ in self._classes])
        if requeued:
            queues[waiter.rank].appendleft(waiter)
        else:
            queues[waiter.rank].append(waiter)
        self._count += 1
        self._bytes += waiter.info.body_bytes
        self._metrics.queue_depth.labels(waiter.info.priority_class).inc()

    def _make_room(self, model: str, waiter: _Waiter) -> None:
        """Shed what must go for `waiter` to fit the bounds: less important requests first, else `waiter`.

        A full class sheds the newest request of its largest flow, `waiter` itself when its own flow is that large.
        """
        name, size = waiter.info.priority_class, waiter.info.body_bytes
        queues = self._queues.get(model)
        if queues and len(queues[waiter.rank]) >= self._config.class_max_requests.get(name, math.inf):
            queue = queues[waiter.rank]
            victim = queue.largest_flow_newest()
            if victim is None or queue.flow_size(victim.info.flow) <= queue.flow_size(waiter.info.flow) + 1:
                self._shed(name, "queue_full")
            self._displace(model, victim)
        while self._count + 1 > self._config.max_requests or self._bytes + size > self._config.max_bytes:
            found = self._newest_less_important(waiter.rank)
            if found is None:
                self._shed(name, "queue_full")
            self._displace(*found)

    def _displace(self, model: str, victim: _Waiter) -> None:
        """Shed a queued request to make room for another."""
        self._remove(model, victim)
        self._metrics.shed.labels(victim.info.priority_class, "displaced").inc()
        victim.future.set_exception(self._shed_error(victim.info.priority_class))

    def _newest_less_important(self, rank: int) -> tuple[str, _Waiter] | None:
        """The newest request of the largest flow of the least important class below `rank`, in any model."""
        for lower in range(len(self._classes) - 1, rank, -1):
            candidates = ((model, queues[lower].largest_flow_newest()) for model, queues in self._queues.items())
            newest = max(((model, waiter) for model, waiter in candidates if waiter is not None),
                         key=lambda item: item[1].enqueued, default=None)
            if newest is not None:
                return newest
        return None

    def _remove(self, model: str, waiter: _Waiter) -> None:
        queues = self._queues.get(model)
        if queues is None or waiter not in queues[waiter.rank]:
            return  # already taken out by a dispatch that found its client gone
        queues[waiter.rank].remove(waiter)
        self._forget(model, waiter)

    def _forget(self, model: str, waiter: _Waiter) -> None:
        self._count -= 1
        self._bytes -= waiter.info.body_bytes
        self._metrics.queue_depth.labels(waiter.info.priority_class).dec()
        if not self._waiting(model):
            del self._queues[model]

    def _dispatch(self, model: str) -> None:
        """Release waiting requests of `model` while the fleet has room for them."""
        while self._waiting(model):
            queues = self._queues[model]
            rank = self._next_rank(model, queues)
            if rank is None:
                self._preempt_for(model)
                return
            waiter = self._next_of(model, queues[rank], rank)
            self._forget(model, waiter)
            if waiter.future.done():
                continue  # cancelled in this loop turn: its client left, and it no longer needs a place
            self._pending[model] += 1
            waiter.future.set_result(None)

    def _next_of(self, model: str, queue: FairQueue[_Waiter], rank: int) -> _Waiter:
        """Take the request of class `rank` to release: its next in turn, unless the class yields to a more important
        one and a request among its next `lookahead` is held where there is room for it (the first such), while its
        next in turn has been passed over fewer than `lookahead` times."""
        head, lookahead = queue.peek(), self._config.lookahead
        if (self._held_with_room is None or head.passed_over >= lookahead or not self._yields(model, rank)
                or self._held_with_room(head.info, self._standing(model, rank, head.preemptible))):
            return queue.popleft()
        for waiter in queue.ahead(lookahead)[1:]:
            if self._held_with_room(waiter.info, self._standing(model, rank, waiter.preemptible)):
                head.passed_over += 1
                queue.take(waiter)
                return waiter
        return queue.popleft()

    def _next_rank(self, model: str, queues: list[FairQueue[_Waiter]]) -> int | None:
        """The class to dispatch from next, None while there is no room.

        The most important waiting class, except every 1/min_share-th dispatch while a lower one waits:
        that one goes to the longest-waiting lower class, which then takes the room of the one above it
        (its reserve does not apply), so no class starves. A reserve only takes room away, so when the most
        important class has none, no class has.
        """
        ranks = [rank for rank, queue in enumerate(queues) if queue]
        top = ranks[0]
        head = queues[top].peek()
        if not self._has_room(head.info, self._standing(model, top, head.preemptible)):
            return None
        if len(ranks) == 1 or self._config.min_share <= 0:
            self._since_low[model] = 0
            return top
        self._since_low[model] = self._since_low.get(model, 0) + 1
        if self._since_low[model] >= 1 / self._config.min_share:
            self._since_low[model] = 0
            return min(ranks[1:], key=lambda rank: queues[rank].peek().enqueued)
        return top

    def _shed_error(self, priority_class: str) -> GatewayError:
        return GatewayError(429, f"the fleet is saturated and the {priority_class} queue cannot take this request; "
                                 "retry later", headers={"Retry-After": str(self._config.retry_after_s)})

    def _shed(self, priority_class: str, reason: str) -> None:
        self._metrics.shed.labels(priority_class, reason).inc()
        raise self._shed_error(priority_class)
