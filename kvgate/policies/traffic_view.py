"""How much of its replicas' traffic a gateway knows of: the requests it sent or learned from its peers, against the
requests the engines finished.

A gateway that knows every request its replicas serve (it is the only one, or its peers share their decisions)
holds the fleet's whole history: where each tenant's conversations went is the same on every gateway, so new
context can follow it. One that sees part of the traffic (several gateways that do not share decisions, or
clients that reach the replicas another way) must place new context by what every gateway computes alike
(policies/tenants.py), or gateways would send one tenant to several replicas.

Each engine counts the requests it finishes (vLLM's `vllm:request_prompt_tokens` histogram's count, aborts left
out). Both sides count from the gateway's first scrape of a replica that shows the counter; both are halved once
the engines' side passes `HORIZON`, so the share follows a change (a peer gateway starting or stopping); an engine
whose counter went back (a restart) starts a new baseline.

Finished requests come late: a fleet's first conversations are placed in its first second, before any has
finished. Until `MIN_FINISHED` have, a gateway without peers judges by what the engines hold instead: the
requests it had open on a replica when a scrape began, against the running and waiting requests that scrape
read. Alone, it had open what the engine holds (and some the engine has not yet taken or has already
answered); beside k gateways, about 1/k of it. A gateway with peers cannot tell their open requests from
strangers', so it waits for the finished counters and counts as seeing every request until then.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_FINISHED = 64  # requests the engines must have finished before the share is judged by them
MIN_HELD = 8  # requests the engines must have been seen holding before the share is judged by the open ones
HORIZON = 2048  # finished requests after which both sides are halved
PARTIAL_BELOW = 2 / 3  # a gateway knowing of less than this share of the finished requests sees part of the traffic


@dataclass(slots=True)
class _Tally:
    """One replica's counts since the gateway's baseline for it."""

    sent: float = 0.0  # requests this gateway sent there or learned a peer sent there
    finished: float = 0.0  # requests the engine finished
    counter: int | None = None  # the engine's finished requests at the last scrape that showed them


class TrafficView:
    """Learns the share of its replicas' requests a gateway knows of."""

    def __init__(self, peers: bool = False) -> None:
        self._tallies: dict[str, _Tally] = {}
        self._peers = peers  # decisions are shared with peer gateways, whose open requests this one cannot see
        self._open = 0  # requests this gateway had open on a replica as a scrape of it began, summed over scrapes
        self._held = 0  # running and waiting requests those scrapes read

    def sent(self, replica: str) -> None:
        """This gateway sent a request to `replica`, or learned that a peer did."""
        tally = self._tallies.get(replica)
        if tally is not None and tally.counter is not None:  # before the baseline the engine's side is not counted
            tally.sent += 1

    def scraped(self, replica: str, finished: int | None, held: int = 0, open_requests: int = 0) -> None:
        """A scrape read the engine's finished requests so far (None: not exported) and the requests it `held`
        (running and waiting), while this gateway had `open_requests` on it as the scrape began."""
        self._open += open_requests
        self._held += held
        if finished is None:
            return
        tally = self._tallies.setdefault(replica, _Tally())
        if tally.counter is not None and finished >= tally.counter:  # else the engine restarted: a new baseline
            tally.finished += finished - tally.counter
        tally.counter = finished
        if sum(each.finished for each in self._tallies.values()) > HORIZON:
            for each in self._tallies.values():
                each.sent, each.finished = each.sent / 2, each.finished / 2

    def seen_share(self) -> float | None:
        """Requests known of over requests finished, all replicas together; before MIN_FINISHED finished, requests
        open over requests held (without peers); None until either is known."""
        finished = sum(tally.finished for tally in self._tallies.values())
        if finished >= MIN_FINISHED:
            return sum(tally.sent for tally in self._tallies.values()) / finished
        if self._peers or self._held < MIN_HELD:
            return None
        return self._open / self._held

    def partial(self) -> bool:
        """Whether the gateway plainly sees only part of its replicas' traffic (unknown counts as whole)."""
        share = self.seen_share()
        return share is not None and share < PARTIAL_BELOW

    def forget(self, replica: str) -> None:
        """Drop a replica that left."""
        self._tallies.pop(replica, None)
