"""One priority class's waiting requests: FIFO within a flow, flows served in turn."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

W = TypeVar("W")


class FairQueue(Generic[W]):
    """Waiters grouped by flow (the Inference Extension's fairness id); popleft() takes the next flow's head.

    A flow that floods the queue therefore waits behind itself, not in front of the other flows of its class.
    """

    def __init__(self, flow_of: Callable[[W], str]) -> None:
        self._flow_of = flow_of
        self._flows: OrderedDict[str, deque[W]] = OrderedDict()  # in turn order: the first one goes next
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[W]:
        for waiters in self._flows.values():
            yield from waiters

    def __contains__(self, waiter: object) -> bool:
        waiters = self._flows.get(self._flow_of(waiter))  # type: ignore[arg-type]
        return waiters is not None and waiter in waiters

    def append(self, waiter: W) -> None:
        """Queue `waiter` last in its flow; a new flow takes its turn after those already waiting."""
        self._flows.setdefault(self._flow_of(waiter), deque()).append(waiter)
        self._count += 1

    def appendleft(self, waiter: W) -> None:
        """Queue `waiter` first in its flow, and its flow next (a request coming back after a preemption)."""
        flow = self._flow_of(waiter)
        self._flows.setdefault(flow, deque()).appendleft(waiter)
        self._flows.move_to_end(flow, last=False)
        self._count += 1

    def peek(self) -> W:
        """The waiter popleft() would take; IndexError when empty."""
        if not self._flows:
            raise IndexError("peek from an empty FairQueue")
        return next(iter(self._flows.values()))[0]

    def popleft(self) -> W:
        """Take the next flow's first waiter; that flow's turn then comes after the others'."""
        flow, waiters = next(iter(self._flows.items()))
        waiter = waiters.popleft()
        if waiters:
            self._flows.move_to_end(flow)
        else:
            del self._flows[flow]
        self._count -= 1
        return waiter

    def ahead(self, count: int) -> list[W]:
        """The first `count` waiters in the order popleft() would take them, were nothing queued meanwhile."""
        flows, found = list(self._flows.values()), []
        for depth in range(count):
            row = [waiters[depth] for waiters in flows if depth < len(waiters)]
            if not row:
                break
            found += row
            if len(found) >= count:
                break
        return found[:count]

    def take(self, waiter: W) -> None:
        """Take `waiter` out in its flow's turn: as popleft() would, its flow's next turn comes after the others'."""
        flow = self._flow_of(waiter)
        self.remove(waiter)
        if flow in self._flows:
            self._flows.move_to_end(flow)

    def remove(self, waiter: W) -> None:
        """Take `waiter` out wherever it is; ValueError when it is not queued."""
        flow = self._flow_of(waiter)
        waiters = self._flows.get(flow)
        if waiters is None:
            raise ValueError("waiter is not queued")
        waiters.remove(waiter)
        if not waiters:
            del self._flows[flow]
        self._count -= 1

    def largest_flow_newest(self) -> W | None:
        """The most recently queued waiter of the flow with the most waiters: what to shed for room."""
        if not self._flows:
            return None
        return max(self._flows.values(), key=len)[-1]

    def flow_size(self, flow: str) -> int:
        """How many waiters `flow` has queued."""
        waiters = self._flows.get(flow)
        return len(waiters) if waiters is not None else 0
