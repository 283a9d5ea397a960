"""Priority classes and fleet saturation: which class a request belongs to, and how much more the fleet takes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvgate.endpoints.types import EndpointState
from kvgate.policies.types import DEFAULT_FLOW

PRIORITY_HEADER = "x-priority"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
_MAX_FLOW_CHARS = 128


class PriorityError(ValueError):
    """A priority header names no known class; the message names the header."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True)
class PriorityConfig:
    """Classes from most to least important, the default, objective names mapped to classes, priority bands."""

    classes: tuple[str, ...] = ("interactive", "batch")
    default: str = "interactive"
    objectives: Mapping[str, str] = field(default_factory=dict)  # objective name -> class
    bands: Mapping[str, int] = field(default_factory=dict)  # class -> lowest InferenceObjective priority it takes


def class_of_priority(priority: int, config: PriorityConfig) -> str:
    """The class of an Inference Extension priority (higher is more important, negative is sheddable).

    With `bands`, the first class (most important first) whose lowest priority it reaches, else the last class;
    without, 0 and above are the first class and negative priorities the last.
    """
    bands = config.bands or {config.classes[0]: 0}
    return next((name for name in config.classes if name in bands and priority >= bands[name]), config.classes[-1])


def classify(headers: Mapping[str, str], config: PriorityConfig, fallback: str | None = None,
             objectives: Mapping[str, int] | None = None) -> str:
    """The request's class: x-priority, else x-gateway-inference-objective, else `fallback` or the default.

    An objective is looked up in `config.objectives` (name -> class), then in `objectives` (the pool's
    InferenceObjectives, name -> priority), else read as an integer priority; priorities map to classes by
    class_of_priority.
    """
    value = headers.get(PRIORITY_HEADER)
    if value is not None:
        name = value.strip().lower()
        if name not in config.classes:
            raise PriorityError(PRIORITY_HEADER, f"header {PRIORITY_HEADER} must be one of "
                                                 f"{', '.join(config.classes)}, got {value[:64]!r}")
        return name
    objective = headers.get(OBJECTIVE_HEADER)
    if objective is not None:
        name = objective.strip()
        if name in config.objectives:
            return config.objectives[name]
        if objectives and name in objectives:
            return class_of_priority(objectives[name], config)
        try:
            return class_of_priority(int(name), config)
        except ValueError:
            raise PriorityError(OBJECTIVE_HEADER, f"header {OBJECTIVE_HEADER} names an unknown objective "
                                                  f"{objective[:64]!r}") from None
    return fallback or config.default


def fairness_id(headers: Mapping[str, str]) -> str:
    """The request's flow within its class: x-gateway-inference-fairness-id (cut to 128 characters), else the default."""
    return headers.get(FAIRNESS_HEADER, "").strip()[:_MAX_FLOW_CHARS] or DEFAULT_FLOW


@dataclass(frozen=True)
class SaturationThresholds:
    """A replica is saturated at this queue depth, KV-cache use or gateway in-flight count (0 = no limit)."""

    queue: int = 5
    kv_cache: float = 0.8
    in_flight: int = 0
    seats: int = 0  # sequences each replica runs at once (vLLM --max-num-seqs); 0 = learn it from /metrics
    seated_queue: int = 0  # with a replica's seats known, requests that may wait inside it; the rest wait in kvgate


def headroom(state: EndpointState, limits: SaturationThresholds, probe: bool = True) -> float:
    """How many more requests a replica takes before it is saturated; infinite when nothing says otherwise.

    Fresh metrics: the scraped queue moved by what the gateway sent and saw finish since. Stale metrics
    (a replica too busy to answer /metrics, say) count only what was sent since the last good scrape: a
    failed scrape neither releases the whole queue at once nor blocks the replica on an old reading. A
    replica never scraped fails open. With the replica's seats known, requests beyond its seats and
    `seated_queue` wait in kvgate's queue, which orders them by priority and hands each the first seat that
    frees up anywhere, instead of in the replica's own queue. `probe` False keeps a request from being the one
    let past a learned seat count (_probe), so that it never waits in a replica's queue unless `seated_queue`
    allows it.
    """
    room = float("inf")
    metrics = state.metrics
    if metrics.scraped_at is not None:
        if not metrics.stale and metrics.kv_cache_usage >= limits.kv_cache:
            return 0.0
        if limits.queue:
            waiting = max(0, state.recent) if metrics.stale else state.estimated_waiting
            room = max(0.0, limits.queue - waiting)
    if state.seats:
        inside = max(limits.seated_queue, _probe(limits)) if probe else limits.seated_queue
        room = min(room, max(0.0, state.seats + inside - state.occupied))
    if limits.in_flight:
        room = min(room, max(0.0, limits.in_flight - state.in_flight))
    return room


def _probe(limits: SaturationThresholds) -> int:
    """Requests let past a replica's seat count: one when the count is learned, since it may be low and only
    a replica running more than it shows more (endpoints/fleet.py); none when the operator configured it."""
    return 0 if limits.seats else 1


def fleet_headroom(candidates: Sequence[EndpointState], limits: SaturationThresholds, reserve: float = 0.0,
                   probe: bool = True) -> float:
    """Requests the candidates take before every one is saturated; 0 means the fleet is saturated.

    `reserve` is the share of the candidates' seats that must stay free for more important classes,
    pooled over the fleet because a request that needs a seat is routed to whichever replica has one.
    `probe` is headroom()'s. A class keeping a reserve sends a replica whose seats are unknown one request
    at a time past its last scraped queue: enough to fill it and show its seat count, never a queue that
    others wait behind.
    """
    room = 0.0
    seated: list[EndpointState] = []
    for state in candidates:
        if state.seats:
            seated.append(state)
        elif reserve > 0:
            room += min(headroom(state, limits), max(0, 1 - state.estimated_waiting))
        else:
            room += headroom(state, limits)
    if seated:
        seated_room = sum(headroom(state, limits, probe) for state in seated)
        if reserve > 0:
            seats = sum(state.seats or 0 for state in seated)
            kept = min(math.ceil(reserve * seats), seats - 1)  # never every seat: the class would starve
            seated_room = min(seated_room, max(0, sum(state.free_seats or 0 for state in seated) - kept))
        room += seated_room
    return room
