"""Preemption: an important request takes the seat of a less important one whose replica has not answered yet.

A non-streamed request of a preemptible class (batch, by default) gets nothing from its replica until its
whole answer is ready, so until then the gateway may cancel it (vLLM aborts a request whose connection
closes) and queue it again at the head of its class: its client sees only a later answer. kvgate lets such
requests fill every seat, and when an interactive request finds none free it preempts the youngest ones on
the replica where that frees a seat, and the KV blocks its prompt takes, soonest
(kvgate.policies.capacity.seat_to_free).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kvgate.endpoints.types import EndpointState
from kvgate.policies.capacity import Tokens, seat_to_free
from kvgate.policies.types import RequestInfo

T = TypeVar("T")


class HeldKvCache(Protocol):
    """What this gateway's requests hold of each replica's KV cache (the Fleet)."""

    def prompt_tokens(self, request: RequestInfo) -> Tokens:
        """The KV cache tokens `request`'s prompt takes on each replica."""
        ...

    def freed_by(self, key: str, requests: Sequence[RequestInfo]) -> float:
        """The KV cache tokens `key` frees once these requests on it end."""
        ...


class Preempted(Exception):
    """The request's seat went to a more important request before its replica answered; it queues again."""


@dataclass(eq=False)
class _Freeing:
    """One preemption: the seat it frees counts once all its victims have let go of theirs."""

    model: str
    victims: int


@dataclass(eq=False)
class Preemptible:
    """One preemptible request on its replica; `signal` resolves when it is preempted."""

    model: str
    replica: str
    rank: int  # its class, 0 = most important
    seq: int  # order of sending: the highest is the youngest
    info: RequestInfo | None = None  # the request (None: unknown; it counts as freeing no KV cache)
    signal: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    freeing: _Freeing | None = None

    @property
    def preempted(self) -> bool:
        """Whether a more important request has taken its seat."""
        return self.signal.done()


class PreemptionRegistry:
    """The preemptible requests on each replica, oldest first, and the preemptions still freeing a seat."""

    def __init__(self, candidates: Callable[[str], Sequence[EndpointState]], kv: HeldKvCache | None = None) -> None:
        self._candidates = candidates  # model -> the replicas that may take it now
        self._kv = kv  # None: victims are chosen by seats alone
        self._on_replica: dict[str, list[Preemptible]] = {}
        self._freeing: Counter[str] = Counter()  # model -> preemptions whose seat is not free yet
        self._seq = itertools.count()

    def track(self, model: str, replica: str, rank: int, info: RequestInfo | None = None) -> Preemptible:
        """Register a preemptible request (`info`) just sent to `replica`."""
        entry = Preemptible(model, replica, rank, next(self._seq), info=info)
        self._on_replica.setdefault(replica, []).append(entry)
        return entry

    async def unless_preempted(self, model: str, replica: str, rank: int, answer: Awaitable[T],
                               info: RequestInfo | None = None) -> T:
        """Await a request's `answer` from `replica` while a more important request may take its seat.

        If one does first, the request is cancelled (vLLM aborts a request whose connection closes) and
        Preempted is raised. Either way it stops being preemptible once this returns.
        """
        entry = self.track(model, replica, rank, info)
        task = asyncio.ensure_future(answer)
        try:
            await asyncio.wait((task, entry.signal), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self.untrack(entry)
        if task.cancelled():
            raise Preempted()
        return task.result()

    def untrack(self, entry: Preemptible) -> None:
        """The request's replica answered, or it finished or was preempted: it holds no preemptible seat now."""
        entries = self._on_replica.get(entry.replica, [])
        if entry in entries:
            entries.remove(entry)
            if not entries:
                del self._on_replica[entry.replica]
        freeing = entry.freeing
        if freeing is not None:
            entry.freeing = None
            freeing.victims -= 1
            if freeing.victims == 0:
                self._freeing[freeing.model] -= 1
                if self._freeing[freeing.model] <= 0:
                    del self._freeing[freeing.model]

    def freeing(self, model: str) -> int:
        """Seats of `model`'s replicas that preemptions are freeing now."""
        return self._freeing[model]

    def has_victims(self, model: str, rank: int) -> bool:
        """Whether a replica that may take `model` runs a request less important than class `rank`."""
        return any(self._victims(state.key, rank) for state in self._candidates(model))

    def _victims(self, replica: str, rank: int) -> list[Preemptible]:
        return [entry for entry in self._on_replica.get(replica, ()) if entry.rank > rank and not entry.preempted]

    def preempt(self, model: str, rank: int, request: RequestInfo | None = None) -> int:
        """Free one seat for a request of `model` and class `rank`, and the KV blocks `request`'s prompt takes (None:
        a seat alone); returns how many requests it preempted (0: none).

        Which ones is kvgate.policies.capacity.seat_to_free's choice.
        """
        candidates = self._candidates(model)
        victims = {state.key: self._victims(state.key, rank) for state in candidates}
        preempted = {state.key: sum(1 for entry in self._on_replica.get(state.key, ()) if entry.preempted)
                     for state in candidates}
        kv = self._kv
        if kv is None or request is None:
            chosen = seat_to_free(candidates, victims, preempted)
        else:
            chosen = seat_to_free(candidates, victims, preempted, kv.prompt_tokens(request),
                                  lambda key, entries: kv.freed_by(key, [entry.info for entry in entries
                                                                         if entry.info is not None]))
        if not chosen:
            return 0
        freeing = _Freeing(model, len(chosen))
        self._freeing[model] += 1
        for entry in chosen:
            entry.freeing = freeing
            entry.signal.set_result(None)
        return len(chosen)
