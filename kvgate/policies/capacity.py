"""The capacity model: how many more requests a replica and a fleet take, and the seats behind that answer.

Every feature that asks "is there room?" asks here: admission (room for one more request of a class),
routing (which replicas have a free seat), preemption (which seat to free) and the fleet's seat learning.
A replica's load is read from its last scrape moved by what the page does not show yet (unseen()); its seats
(vLLM --max-num-seqs) are configured or learned from /metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeVar

from kvgate.endpoints.types import EndpointState, ReplicaMetrics

_GROWTH = 0.1  # share of its running count a replica of unknown seats may gain per scrape (growth_step)


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """The KV cache tokens one prompt takes on each replica: all of it (`whole`), less on a replica where requests in
    flight hold its leading blocks already (`on`: replica key -> tokens; policies/held_kv.py)."""

    whole: int
    on: Mapping[str, int] = field(default_factory=dict)

    def at(self, key: str) -> int:
        """What the prompt takes on replica `key`."""
        return self.on.get(key, self.whole)


Tokens = int | PromptTokens  # a prompt's length, the same on every replica, or what it takes on each


def _tokens_at(tokens: Tokens, key: str) -> int:
    return tokens.at(key) if isinstance(tokens, PromptTokens) else tokens


@dataclass(frozen=True)
class SaturationThresholds:
    """A replica is saturated at this queue depth, KV-cache use or gateway in-flight count (0 = no limit; a KV-cache
    use of 1.0 = no limit: vLLM runs with its cache full and admits each request as blocks free)."""

    queue: int = 5
    kv_cache: float = 0.8
    in_flight: int = 0
    seats: int = 0  # sequences each replica runs at once (vLLM --max-num-seqs); 0 = learn it from /metrics
    seated_queue: int = 0  # with a replica's seats known, requests that may wait inside it; the rest wait in kvgate

    @property
    def kv_bounded(self) -> bool:
        """Whether the KV cache saturates a replica at all (`kv_cache` below 1.0)."""
        return self.kv_cache < 1.0


def unseen(state: EndpointState) -> int:
    """Requests on the replica that its last scrape does not show (negative when more finished than were sent).

    Those sent since the scrape less those finished since, and at least what this gateway has open on it beyond
    the scraped count: vLLM sets its gauges once per engine step, after scheduling, so a request that reached it
    during the step before a scrape is in neither the page nor what was sent since (a step lasts up to seconds
    on a CPU engine, or during a long prefill).
    """
    metrics = state.metrics
    return max(state.recent, state.in_flight - metrics.running - metrics.waiting)


def occupied(state: EndpointState) -> int:
    """Requests on the replica now, running or waiting: the last scrape moved by what it does not show yet (before a
    first scrape, what was sent there)."""
    return max(0, state.metrics.running + state.metrics.waiting + unseen(state))


def estimated_waiting(state: EndpointState, cautious: bool = False, seats: int | None = None) -> int:
    """The replica's queue now: the last scraped depth moved by what the scrape does not show yet (unseen).

    With its seat count known, whatever is on the replica beyond its seats. Without it, a request sent since
    the scrape is taken to run when the scrape showed no queue (an idle replica takes a burst at once, and
    the next scrape shows where it went) and to wait behind the queue it showed; `cautious` counts every
    request sent since a scrape that showed no queue as waiting until the next scrape (only those: a request the
    page misses while its engine has no queue is running, or in the engine's server on its way in or out, and
    on a CPU engine that lag lasts the whole load). 0 for a replica never scraped. `seats` overrides the state's
    (headroom passes what the replica runs at once now, its KV cache included).
    """
    metrics = state.metrics
    seats = seats or state.seats
    if metrics.scraped_at is None:
        return 0
    if seats:
        return max(0, occupied(state) - seats)
    if not metrics.waiting:
        return max(0, state.recent) if cautious else 0
    return max(0, metrics.waiting + unseen(state))


def kv_usage(state: EndpointState) -> float:
    """The replica's KV cache use now: the scraped share moved by what it holds beyond that reading (_kv_since), so
    that a replica a scrape showed full takes the next request as soon as one of its own frees blocks, not a scrape
    later, and requests decided on one scrape do not all count the same free blocks. Where the cache size is unknown,
    the scraped share less what the requests that finished since held when more finished than were sent (the running
    ones' mean)."""
    metrics = state.metrics
    capacity = metrics.kv_capacity_tokens
    if capacity:
        return min(1.0, max(0.0, metrics.kv_cache_usage + _kv_since(state, 0) / capacity))
    since = unseen(state)
    if since >= 0 or metrics.running <= 0:
        return metrics.kv_cache_usage
    return max(0.0, metrics.kv_cache_usage * (1.0 + since / metrics.running))


def _kv_since(state: EndpointState, tokens: int) -> float:
    """KV cache tokens the replica holds now beyond its last scrape's reading.

    What this gateway's requests took and freed since (kv_grown: a prefix block shared by several of them once, as
    vLLM counts it, so a request whose system prompt another still runs frees only its own part), and for each
    request that neither the page nor kv_grown shows (sent by another gateway, or on its way into the engine when
    the page was read), the running ones' mean or a prompt of `tokens`, whichever is larger.
    """
    metrics = state.metrics
    capacity = metrics.kv_capacity_tokens or 0
    mean = metrics.kv_cache_usage * capacity / metrics.running if metrics.running > 0 else 0.0
    unshown = max(0, state.in_flight - metrics.running - metrics.waiting - state.recent)
    return state.kv_grown + (state.elsewhere + unshown) * max(mean, tokens)


def full_at(metrics: ReplicaMetrics) -> int | None:
    """What a replica runs when its last fresh scrape shows a queue: vLLM schedules before it sets its gauges, so a
    request still waiting then found no seat, KV room or token budget free; None when the scrape shows no queue."""
    if metrics.stale or metrics.scraped_at is None or metrics.waiting <= 0:
        return None
    return metrics.running


def likely_seats(state: EndpointState) -> int | None:
    """The replica's seats, else those its peers showed (peer_seats), or what it runs when that is more (it has
    at least as many); None while both are unknown."""
    if state.seats or not state.peer_seats:
        return state.seats
    return max(state.peer_seats, state.metrics.running)


def free_seats(state: EndpointState) -> int | None:
    """Seats the replica has free now (likely_seats), None while its seat count is unknown."""
    seats = likely_seats(state)
    return None if not seats else max(0, seats - occupied(state))


def headroom(state: EndpointState, limits: SaturationThresholds, probe: bool = True, yields: bool = False,
             fits: bool = False) -> float:
    """How many more requests a replica takes before it is saturated; infinite when nothing says otherwise.

    Fresh metrics: the scraped queue moved by what the gateway sent and saw finish since, and so the KV cache use
    (kv_usage) where `probe` is False, that is while another class has traffic. A class alone waits for a scrape
    to show a full cache's room: released when one request ends anywhere, it may go where that one ended rather
    than where its context is (on real engines a class alone hit less when released so; docs/benchmarks.md). Stale
    metrics (a replica too busy to answer /metrics, say) count only what was sent since the last good scrape: a
    failed scrape neither releases the whole queue at once nor blocks the replica on an old reading. A
    replica never scraped fails open. With the replica's seats known, requests beyond its seats and
    `seated_queue` wait in kvgate's queue, which orders them by priority and hands each the first seat that
    frees up anywhere, instead of in the replica's own queue. `probe` False keeps a request from being the one
    let past a learned seat count (_probe), so that it never waits in a replica's queue unless `seated_queue`
    allows it, and counts every request sent since the scrape to a replica of unknown seats as waiting: only
    a request that nobody more important waits behind is let into a replica on the hope that it has room.
    A class that `yields` to a more important one also counts what the replica's KV cache holds at once below
    `kv_cache` (kv_slots), so that it leaves room, unless its prompt `fits` the replica's free KV blocks: kv_room
    counted them beside the room it leaves. For a request that does not probe, a replica of unknown seats whose
    scrape shows a queue is full at its running count (full_at): it would wait there behind the queue, first
    come first served; else it has the seats its peers showed (peer_seats), except for a class that yields,
    which grows toward them (growth_step) and so still finds a replica that has more. A request that `fits` the
    replica's free KV blocks (kv_room counted them) is not held back by `kv_cache`: what a class that yields leaves
    free is counted in blocks (kv_room's reserve, kept on one replica: _rooms), and the rest is the room the
    classes below leave the class they yield to.
    """
    room = float("inf")
    metrics = state.metrics
    seats = slots(state.seats, metrics, limits.kv_cache) if yields and not fits else state.seats
    if not seats and not probe:
        seats = full_at(metrics) or (None if yields else likely_seats(state))
    if metrics.scraped_at is not None:
        full = limits.kv_bounded and (metrics.kv_cache_usage if probe else kv_usage(state)) >= limits.kv_cache
        if not metrics.stale and full and not fits:
            return 0.0
        if limits.queue:
            waiting = max(0, state.recent) if metrics.stale else estimated_waiting(state, not probe, seats)
            room = max(0.0, limits.queue - waiting)
    if seats:
        inside = max(limits.seated_queue, _probe(limits)) if probe else limits.seated_queue
        room = min(room, max(0.0, seats + inside - occupied(state)))
    if limits.in_flight:
        room = min(room, max(0.0, limits.in_flight - state.in_flight))
    return room


def _probe(limits: SaturationThresholds) -> int:
    """Requests let past a replica's seat count: one when the count is learned, since it may be low and only
    a replica running more than it shows more (SeatLearner); none when the operator configured it."""
    return 0 if limits.seats else 1


def fleet_headroom(candidates: Sequence[EndpointState], limits: SaturationThresholds, reserve: float = 0.0,
                   probe: bool = True, yields: bool = False, tokens: Tokens = 0, kv_reserve: int = 0) -> float:
    """Requests the candidates take before every one is saturated; 0 means the fleet is saturated.

    `reserve` is the share of the candidates' seats (known, or likely from their peers') that must stay free for
    more important classes, pooled over the fleet because a request that needs a seat is routed to whichever
    replica has one.
    `probe` is headroom()'s. A class that `yields` to a more important one counts what a replica's KV cache
    holds (kv_slots) as well as its seats where its prompt's blocks are not counted (kv_room), and fills a replica
    whose seats are unknown only by growth_step() past its last scrape, one replica at a time (first_to_fill), so
    that its requests never make a queue that others wait behind. A class that does not probe finds no room where a
    prompt of `tokens` (0 = not asked) would wait for KV blocks (kv_room), and leaves room for a prompt of
    `kv_reserve` tokens kept for a more important class on one replica (rooms).
    """
    room = 0.0
    seated: list[tuple[EndpointState, int]] = []
    rooms = _rooms(candidates, limits, probe, yields, tokens, kv_reserve)
    for state in candidates:
        by_slots = yields and not _counts_kv(state, limits, probe, tokens)
        seats = slots(likely_seats(state), state.metrics, limits.kv_cache) if by_slots else likely_seats(state)
        if seats:
            seated.append((state, seats))
        else:
            room += rooms[state.key]
    if seated:
        seated_room = sum(rooms[state.key] for state, _ in seated)
        if reserve > 0:
            total = sum(seats for _, seats in seated)
            kept = min(math.ceil(reserve * total), total - 1)  # never every seat: the class would starve
            free = sum(max(0, seats - occupied(state)) for state, seats in seated)
            seated_room = min(seated_room, max(0, free - kept))
        room += seated_room
    return room


def with_room(candidates: Sequence[EndpointState], limits: SaturationThresholds, standing: ClassStanding,
              tokens: Tokens = 0, among: Set[str] | None = None) -> frozenset[str]:
    """The keys of the candidates (of those in `among`, when given) that take one more request of a class so
    standing, its seat reserve aside (`tokens` as in fleet_headroom)."""
    rooms = _rooms(candidates, limits, standing.probes, standing.yields, tokens, standing.kept_kv_reserve)
    return frozenset(key for key, room in rooms.items() if room >= 1 and (among is None or key in among))


def _rooms(candidates: Sequence[EndpointState], limits: SaturationThresholds, probe: bool, yields: bool,
           tokens: Tokens, kv_reserve: int) -> dict[str, float]:
    """Each candidate's room for one more request of a class (_room_on), with room for a more important class's
    prompt of `kv_reserve` tokens kept on one replica of the fleet.

    Kept on one, not on each: an interactive request is routed to whichever replica has room for it, and on a fleet
    whose cache holds a few prompts a replica (issue 16's holds about four), a prompt's room kept on every replica
    holds a large share of the fleet's cache idle. The replica that keeps it is the one where keeping it costs this class the fewest requests, of those
    where the prompt's blocks are free now (the first by key on a tie, as every gateway picks); where it fits on
    none, every replica keeps it, so that this class takes no room until a replica has that prompt's free again.
    """
    first = first_to_fill(candidates) if yields else None
    free = {state.key: _room_on(state, limits, probe, yields, tokens, first) for state in candidates}
    if not kv_reserve:
        return free
    kept = {state.key: _room_on(state, limits, probe, yields, tokens, first, kv_reserve) for state in candidates}
    able = [state.key for state in candidates
            if _counts_kv(state, limits, probe, kv_reserve) and kv_room(state, kv_reserve) >= 1]
    if not able:
        return kept
    keeper = min(able, key=lambda key: (free[key] - kept[key], key))
    return free | {keeper: kept[keeper]}


def first_to_fill(candidates: Sequence[EndpointState]) -> str | None:
    """While no candidate's seats are known (likely_seats), the one replica a class that yields fills: the first
    by key of those whose metrics are fresh and that have not been full yet (`EndpointState.filled`); None once a
    count is known or none is left to fill (a replica whose page cannot be read teaches nothing, so the next one
    fills meanwhile).

    Seats are learned from a queue, so a replica must fill before its count is known. Filled one at a time, only
    that replica makes a queue that interactive requests could meet, and they find seats on the others; once it
    shows its seats the others take that count (peer_seats) and keep the reserve from the start. A replica full
    for its KV cache, not its seats, shows no count: the next one fills then. Every gateway picks the same.
    """
    if any(likely_seats(state) for state in candidates):
        return None
    return min((state.key for state in candidates if not state.metrics.stale and not state.filled), default=None)


def kv_room(state: EndpointState, tokens: int, reserve: int = 0) -> float:
    """How many prompts of `tokens` find KV blocks free on the replica now, as far as its last fresh scrape tells,
    beside the blocks of a prompt of `reserve` tokens (0: none) kept free for a more important class.

    vLLM starts a request only once the blocks of its whole prompt are free. Free here is the scraped free share of
    the cache, less a block for each running sequence to grow by, less what the replica holds beyond that reading
    (_kv_since); each prompt takes its whole blocks and one to grow by. A count, not a yes or no: requests released
    together all decide on the same scrape, and a replica with blocks for one must not take them all. Infinite where
    the cache size is unknown or the metrics are stale (no reason to think not).
    """
    free = _kv_free_now(state, tokens)
    if free is None:
        return math.inf
    block = state.metrics.block_size
    free -= _prompt_tokens_held(reserve, block) if reserve else 0
    return max(0, math.floor(free / _prompt_tokens_held(tokens, block)))


def kv_short(state: EndpointState, tokens: int) -> float:
    """The KV cache tokens the replica must free before a prompt of `tokens` finds its blocks free there (as kv_room
    counts them); 0 where it does, or where the cache size is unknown or the metrics are stale."""
    free = _kv_free_now(state, tokens)
    if free is None:
        return 0.0
    return max(0.0, _prompt_tokens_held(tokens, state.metrics.block_size) - free)


def _kv_free_now(state: EndpointState, tokens: int) -> float | None:
    """KV cache tokens free on the replica now for prompts of `tokens` (_kv_free moved by _kv_since); None where the
    cache size is unknown or the metrics are stale."""
    free = _kv_free(state.metrics)
    return None if free is None else free - _kv_since(state, tokens)


def kv_seats(state: EndpointState, tokens: int) -> int | None:
    """Sequences the replica runs at once while prompts of `tokens` arrive: those its last fresh scrape shows
    running and as many more as its free KV blocks held then (each its whole blocks and one to grow by); None where
    the cache size is unknown or the metrics are stale. What it holds beyond that waits for blocks, as beyond its
    seats."""
    free = _kv_free(state.metrics)
    if free is None:
        return None
    return state.metrics.running + max(0, math.floor(free / _prompt_tokens_held(tokens, state.metrics.block_size)))


def _kv_free(metrics: ReplicaMetrics) -> float | None:
    """KV cache tokens free at the last fresh scrape, less a block for each running sequence to grow by; None where
    the cache size is unknown or the metrics are stale."""
    capacity, block = metrics.kv_capacity_tokens, metrics.block_size
    if capacity is None or block is None or metrics.stale or metrics.scraped_at is None:
        return None
    return capacity * (1.0 - metrics.kv_cache_usage) - block * metrics.running


def _prompt_tokens_held(tokens: int, block: int) -> int:
    """The KV tokens a prompt of `tokens` takes: its whole blocks and one to grow by."""
    return math.ceil(tokens / block) * block + block


def _room_on(state: EndpointState, limits: SaturationThresholds, probe: bool, yields: bool, tokens: Tokens,
             first: str | None = None, kv_reserve: int = 0) -> float:
    """headroom() of one replica; for a class that does not probe, at most as many as the KV blocks its prompt takes
    there are free for (kv_room; unless `kv_cache` is 1.0: the operator said the KV cache never saturates);
    for a class that yields, while the replica's seats are unknown, at most growth_step() past its last scrape
    (and `seated_queue` more, as for a replica whose seats are known), and nothing past it while another replica,
    `first`, fills first (first_to_fill)."""
    need = _tokens_at(tokens, state.key)
    kv = kv_room(state, need, kv_reserve) if _counts_kv(state, limits, probe, tokens) else math.inf
    if not kv:
        return 0.0
    room = min(kv, headroom(state, limits, probe, yields, fits=math.isfinite(kv)))
    metrics = state.metrics
    if not yields or state.seats or metrics.scraped_at is None:
        return room
    if metrics.waiting:  # it is full: only what may wait inside a replica (seated_queue) goes on
        allowed = limits.seated_queue - metrics.waiting - unseen(state)
    else:  # growth is what this gateway opened there, net, since the scrape started: neither what the page lags
        # behind its count nor a request that took the place of one finished while the scrape was in flight
        step = growth_step(metrics, state.peer_seats) if first in (None, state.key) else 0
        allowed = step + limits.seated_queue - state.grown
    return min(room, max(0, allowed))


def _counts_kv(state: EndpointState, limits: SaturationThresholds, probe: bool, tokens: Tokens) -> bool:
    """Whether a request's room on the replica is counted in KV blocks (kv_room): it does not probe, its prompt is
    known, the KV cache saturates at all (`kv_cache` below 1.0), and the replica's cache size and fresh metrics tell
    what is free."""
    return (not probe and bool(_tokens_at(tokens, state.key)) and limits.kv_bounded
            and _kv_free(state.metrics) is not None)


def growth_step(metrics: ReplicaMetrics, peer_seats: int | None = None) -> int:
    """Requests a replica of unknown seats may gain between two scrapes that show no queue: a tenth of what it
    runs, at least one. Its seats are learned only once it is full, so it must fill; growing by a share of
    itself fills a large replica in a few scrapes and leaves at most that share waiting inside it when full.

    Where another replica of its model has shown its seats (`peer_seats`), the step stops there and takes one
    more: replicas of one Deployment run the same --max-num-seqs, and replicas filling in step would otherwise
    all pass their seats in the same scrape, leaving a tenth of each waiting inside, first come first served,
    ahead of the next interactive request wherever it goes. A replica that then runs more than its peers' seats
    has more, and grows by its tenth again.
    """
    step = max(1, math.ceil(_GROWTH * metrics.running))
    if peer_seats is not None and metrics.running <= peer_seats < metrics.running + step:
        return max(1, peer_seats - metrics.running)
    return step


def peer_seats(learned: Mapping[str, int], models: Mapping[str, frozenset[str]]) -> dict[str, int]:
    """For each replica in `models` whose seats are not in `learned`: the fewest seats learned on another replica
    that serves one of its models (a replica whose models are unknown shares them all)."""
    fewest: dict[str, int] = {}  # model -> fewest seats learned on a replica serving it
    for key, seats in learned.items():
        for model in models.get(key, frozenset()):
            fewest[model] = min(seats, fewest.get(model, seats))
    shared = min((seats for key, seats in learned.items() if not models.get(key)), default=None)
    found: dict[str, int] = {}
    for key, served in models.items():
        if key in learned:
            continue
        counts = [fewest[model] for model in served if model in fewest] if served else list(learned.values())
        if shared is not None:
            counts.append(shared)
        if counts:
            found[key] = min(counts)
    return found


@dataclass(frozen=True, slots=True)
class ClassStanding:
    """Where a request's class stands against the others when it asks for room."""

    reserve: float = 0.0  # share of seats its class leaves free for more important ones (AdmissionConfig.reserve)
    yields: bool = False  # a more important class sent traffic recently
    preemptible: bool = False  # it gives up its seat on demand
    may_preempt: bool = False  # it could take the seat of a less important request now
    alone: bool = True  # no other class sent traffic recently: nobody's order depends on where it waits
    kv_reserve: int = 0  # prompt tokens it leaves KV room for on each replica: a more important class's largest lately

    @property
    def kept_reserve(self) -> float:
        """The reserve it keeps now: none unless a more important class is active, none when preemptible."""
        return self.reserve if self.yields and not self.preemptible else 0.0

    @property
    def kept_kv_reserve(self) -> int:
        """The KV room it leaves now for a more important class's prompt (kv_reserve): while that class is active,
        preemptible or not (giving blocks up on demand costs the waiting request an engine step and the victim its
        work; docs/benchmarks.md)."""
        return self.kv_reserve if self.yields else 0

    @property
    def probes(self) -> bool:
        """Whether it may be sent on the hope that a replica has room (headroom's `probe`): past a learned seat
        count, or to a replica of unknown seats beyond what its last scrape showed. Only a class alone may: in a
        mix of classes a request that waits inside a replica waits first come first served, so kvgate keeps it."""
        return self.alone and not self.yields and not self.may_preempt


def room_for(candidates: Sequence[EndpointState], limits: SaturationThresholds, standing: ClassStanding,
             tokens: Tokens = 0) -> float:
    """Requests of one class the candidates take now; infinite when there is no candidate (its 503 is at once).

    A replica's own queue is first come first served, so while a more important class has traffic a
    request is never the one let past a replica's learned seat count to wait there (it could take the
    next seat ahead of a more important one), and a request that may preempt one takes a free seat
    rather than a place behind a preemptible one; only `seated_queue` puts requests in a replica's queue
    then. A preemptible request keeps no seat reserve, since it gives up its seat on demand. `tokens` is the
    asking request's prompt length (fleet_headroom).
    """
    if not candidates:
        return float("inf")
    return fleet_headroom(candidates, limits, standing.kept_reserve, standing.probes, standing.yields, tokens,
                          standing.kept_kv_reserve)


def kv_slots(metrics: ReplicaMetrics, kv_full: float) -> int | None:
    """Sequences like those running now that fit in the replica's KV cache below `kv_full`; None while unknown.

    vLLM admits a request only when its blocks are free, so on a replica whose prompts are long its KV cache,
    not its seats, bounds what runs at once: the running sequences hold `kv_cache_usage` of the cache between
    them, and `kv_full` of it holds kv_full / usage times as many (at least one). Admission counts with it for a
    class that yields to a more important one (so that KV room is left for it) where it cannot count the free
    blocks themselves (kv_room: the cache size unknown, or no prompt asked); a class alone fills the cache
    as the replica itself would, and routing keeps to seats, since its cost model weighs a full cache itself.
    """
    if metrics.stale or metrics.scraped_at is None or metrics.running <= 0 or metrics.kv_cache_usage <= 0:
        return None
    return max(1, math.floor(kv_full * metrics.running / metrics.kv_cache_usage))


def slots(seats: int | None, metrics: ReplicaMetrics, kv_full: float) -> int | None:
    """Sequences the replica runs at once now: its seats, fewer while its KV cache holds fewer (kv_slots)."""
    known = [count for count in (seats, kv_slots(metrics, kv_full)) if count]
    return min(known) if known else None


def has_free_seat(state: EndpointState) -> bool:
    """Whether the replica can start a request at once, as far as is known (an unknown seat count says yes)."""
    return free_seats(state) != 0


class SeatLearner:
    """Learns each replica's seat count, which vLLM does not export, from its running count under a queue.

    A queue seen on two scrapes in a row beside the same running count, with an engine step between them,
    means every seat was taken (an arrival between two engine steps waits for one step only, and under load
    such arrivals queue beside a running count that moves; two scrapes within one long step, a burst's
    prefill, see the same page and prove nothing), so that count is what the replica holds at once, unless
    the KV cache was full (at `kv_full` or more): then the queue waits for blocks, and the running count
    says how many of these prompts fit, not how many seats there are. Once known it only grows: a replica
    never runs more than it has seats, and headroom() lets one request past a learned count so that a
    low one corrects itself. It also tells which replicas have been full at all (filled): a queue on two scrapes
    in a row, whatever bound it.
    """

    def __init__(self, kv_full: float) -> None:
        self._kv_full = kv_full
        self._seats: dict[str, int] = {}
        # replicas whose last scrape showed a queue -> their running count and engine steps then, and whether their
        # seats bound it (the KV cache was not full)
        self._queued: dict[str, tuple[int, int | None, bool]] = {}
        self._filled: set[str] = set()  # replicas that showed a queue on two scrapes in a row

    def observe(self, key: str, metrics: ReplicaMetrics) -> int | None:
        """Take in one successful scrape of `key`; returns its seat count when this scrape changed it."""
        seat_bound = metrics.waiting > 0 and metrics.kv_cache_usage < self._kv_full
        before = self._queued.get(key)
        queued_twice = seat_bound and before is not None and before[2] and before[0] == metrics.running and (
            before[1] is None or metrics.engine_steps is None or metrics.engine_steps > before[1])
        if metrics.waiting > 0:
            if before is not None:
                self._filled.add(key)
            self._queued[key] = (metrics.running, metrics.engine_steps, seat_bound)
        else:
            self._queued.pop(key, None)
        if queued_twice or key in self._seats:
            seats = max(self._seats.get(key, 0), metrics.running)
            if seats and seats != self._seats.get(key):
                self._seats[key] = seats
                return seats
        return None

    def learned(self) -> Mapping[str, int]:
        """Every replica's learned seat count, read-only."""
        return MappingProxyType(self._seats)

    def filled(self) -> Set[str]:
        """The replicas that have shown a queue on two scrapes in a row, for their seats or their KV cache."""
        return self._filled

    def seats(self, key: str) -> int | None:
        """The learned seat count of `key`, None while unknown."""
        return self._seats.get(key)

    def forget(self, key: str) -> None:
        """Drop what was learned about a replica that left."""
        self._seats.pop(key, None)
        self._queued.pop(key, None)
        self._filled.discard(key)


class SeatHolder(Protocol):
    """A request holding a seat it would give up on demand."""

    @property
    def seq(self) -> int:
        """Order of sending: the highest is the youngest."""
        ...


H = TypeVar("H", bound=SeatHolder)


def seat_to_free(candidates: Sequence[EndpointState], victims: Mapping[str, Sequence[H]],
                 preempted: Mapping[str, int], tokens: Tokens = 0,
                 freed: Callable[[str, Sequence[H]], float] | None = None) -> list[H]:
    """The requests to preempt so that a request whose prompt takes `tokens` finds a seat, and its KV blocks, free
    soonest; empty when no replica can free them this way.

    `victims` lists each replica's preemptible requests oldest first, `preempted` how many on it already let
    go. On a replica whose seats are known, or else whose KV cache holds a known number of sequences like those
    it runs (kv_slots, filled to the brim), or else which shows a queue (full_at), or else whose peers showed
    their seats (peer_seats), freeing one takes as many of its youngest victims as it holds
    requests beyond that count, plus one (a request waiting inside it holds no seat). Where the prompt's blocks are
    not free there (kv_short) and `freed` tells the KV cache tokens a set of victims frees (only the blocks no other
    request holds: a victim whose system prompt another request runs frees its own question's), it takes instead
    the fewest that free them (_freeing_kv), and none where all of them would not. The replica needing the fewest
    wins, then the one with the youngest victim: the youngest has done the least work, so little is lost.
    """
    best: tuple[tuple[int, int], list[H]] | None = None
    for state in candidates:
        mine = victims.get(state.key, ())
        seats = state.seats or kv_slots(state.metrics, 1.0) or full_at(state.metrics) or likely_seats(state)
        if not seats or not mine:
            continue
        held = occupied(state) - preempted.get(state.key, 0)
        need = max(1, held - seats + 1)
        if need > len(mine):
            continue
        short = kv_short(state, _tokens_at(tokens, state.key)) if freed is not None else 0.0
        chosen = list(mine[-need:]) if not short else _freeing_kv(state.key, mine, need, short, freed)
        if not chosen:
            continue
        order = (len(chosen), -max(holder.seq for holder in chosen))
        if best is None or order < best[0]:
            best = (order, chosen)
    return [] if best is None else best[1]


def _freeing_kv(key: str, victims: Sequence[H], need: int, short: float,
                freed: Callable[[str, Sequence[H]], float]) -> list[H]:
    """The fewest of `victims` on replica `key`, at least `need`, that free `short` KV cache tokens between them, the
    youngest last one that does; empty when all of them do not.

    How many: those that free the most alone, taken in turn until they free enough. Which: all but the last of those,
    and the youngest victim that frees enough beside them (a younger one has done less work, so less is lost)."""
    ranked = sorted(victims, key=lambda holder: (freed(key, [holder]), holder.seq), reverse=True)
    count = next((count for count in range(need, len(ranked) + 1) if freed(key, ranked[:count]) >= short), None)
    if count is None:
        return []
    base = ranked[:count - 1]
    last = next(holder for holder in reversed(victims)
                if holder not in base and freed(key, [*base, holder]) >= short)
    return [*base, last]
