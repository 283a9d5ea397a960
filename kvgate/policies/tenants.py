"""Tenant placement every gateway computes alike: each busy placement key (a tenant's system prompt) gets one home.

Rendezvous hashing alone gives a tenant a home every gateway agrees on, but homes land unevenly (24 tenants on
three replicas hash about 10 / 8 / 6), and the load bound then spills a share of a busy home's new
conversations, each gateway by its own counts: a spilled tenant is cached on two replicas and its conversations
miss each other's system prompt. Instead, the recently busy keys are assigned whole, as a bin packing every
gateway can repeat from what it sees:

- each key's popularity is its share of the gateway's recent requests (decayed over the load bound's window);
- weights are coarse, so that noise does not reorder or resize tenants, and true to the load, so that a home
  holds its share: the light keys (all of them, when popularity is even) weigh one unit, the mean light key's
  requests; a heavy key (over twice the unit) weighs its ratio to the unit, rounded to a half power of two.
  Light keys are not rounded up to the mean of all keys, which under skew would shrink the heavy keys' share
  and overload their homes;
- a key changes class or weight only once its ratio is half a power of two past the boundary, so a tenant near
  one does not flap (each flap moves tenants, and a moved tenant's next conversation misses its system prompt);
- keys go heaviest first (ties by hash), each to the first replica in its own rendezvous order whose assigned
  weight stays within a fair share of the total, or to the least loaded when none has room.

The result is a pure function of the busy keys, their coarse weights and the replica set, recomputed every
few dozen requests: gateways behind a round-robin front see the same tenants at the same shares, so they hold
the same map without talking. A key seen once is no tenant (a one-off prompt); it keeps its rendezvous home.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.rendezvous import rendezvous_weight

BUSY = 1.5  # decayed requests a key needs to be placed as a tenant: seen at least twice lately
HOT = 2.0  # a key this many times the unit (the mean light key's requests) is heavy
STEP = 0.5  # heavy keys' weights are powers of two in steps of this exponent
HYSTERESIS = math.sqrt(2)  # a class or weight changes once its key's ratio is this factor past the boundary
REFRESH_SHARE = 8  # the map is recomputed after 1/REFRESH_SHARE of the window's requests
MAX_TENANTS = 256  # the busiest keys placed as tenants; lighter ones keep their rendezvous home
MAX_TRACKED = 1024  # keys whose popularity is followed (the lightest are dropped beyond twice this)


def _rounded(ratio: float) -> float:
    """The weight on the `STEP` grid nearest to `ratio`."""
    return 2.0 ** (round(math.log2(ratio) / STEP) * STEP)


def coarse_weights(counts: Mapping[int, float], previous: Mapping[int, float] | None = None) -> dict[int, float]:
    """Each busy key's weight: 1 for a light key, the rounded ratio to the mean light key for a heavy one; a key
    keeps its `previous` class and weight until its ratio is `HYSTERESIS` past a boundary."""
    previous = previous or {}

    def heavy(key: int, unit: float) -> bool:
        threshold = HOT / HYSTERESIS if previous.get(key, 1.0) > 1.0 else HOT * HYSTERESIS
        return counts[key] >= threshold * unit

    light, unit = set(counts), 0.0
    while light:  # taking out the heavy keys lowers the unit, which may make more keys heavy
        unit = sum(counts[key] for key in light) / len(light)
        grown = {key for key in light if heavy(key, unit)}
        if not grown:
            break
        light -= grown
    weights = dict.fromkeys(light, 1.0)
    for key in counts.keys() - light:
        ratio, was = counts[key] / unit, previous.get(key, 1.0)
        held = _rounded(ratio) if was <= 1.0 else \
            min(max(was, _rounded(ratio / HYSTERESIS)), _rounded(ratio * HYSTERESIS))
        weights[key] = max(HOT, held)
    return weights


def assign(weights: Mapping[int, float], replicas: Sequence[str]) -> dict[int, str]:
    """Heaviest key first, each to the first replica in its rendezvous order with room for it within a fair share
    (half a unit of rounding allowed), else to the least loaded replica; ties by key."""
    room = sum(weights.values()) / len(replicas) + 0.5
    load = dict.fromkeys(replicas, 0.0)
    homes: dict[int, str] = {}
    for key in sorted(weights, key=lambda k: (-weights[k], k)):
        weight = weights[key]
        order = sorted(replicas, key=lambda replica: (-rendezvous_weight(key, replica), replica))
        home = next((replica for replica in order if load[replica] + weight <= room),
                    min(order, key=load.__getitem__))
        load[home] += weight
        homes[key] = home
    return homes


class TenantPlacement:
    """Follows the popularity of placement keys and maps the busy ones to a home replica each."""

    def __init__(self) -> None:
        self._counts: dict[int, tuple[float, int]] = {}  # key -> (decayed count, tick it was last brought to)
        self._tick = 0
        self._window = 1  # the share bound's window (policies/balance.py), as the policy last gave it
        self._weights: dict[int, float] = {}
        self._homes: dict[int, str] | None = None  # assigned from the weights when first asked after a weighing
        self._replicas: tuple[str, ...] = ()
        self._weighed_at = 0
        self.unit = 0.0  # the mean light tenant's decayed requests at the last weighing (0 while none is busy)

    def observe(self, key: int, window: int) -> None:
        """One more request with this placement key; popularity decays over `window` requests."""
        self._window = window
        self._tick += 1
        self._counts[key] = (self._count(key) + 1.0, self._tick)
        if len(self._counts) > 2 * MAX_TRACKED:
            busiest = sorted(self._counts, key=self._count, reverse=True)[:MAX_TRACKED]
            self._counts = {key: self._counts[key] for key in busiest}
        if self._tick - self._weighed_at >= self._window / REFRESH_SHARE:
            self._reweigh()

    def is_new(self, key: int) -> bool:
        """Whether the key was not seen lately before its last request: a tenant new to the fleet, or a one-off."""
        return self._count(key) < BUSY

    def home(self, key: int, candidates: Sequence[EndpointState]) -> str | None:
        """The replica the key is assigned to among the candidates; None for a key that is no busy tenant."""
        replicas = tuple(sorted(state.key for state in candidates))
        if self._homes is None or replicas != self._replicas:
            self._replicas, self._homes = replicas, assign(self._weights, replicas) if replicas else {}
        return self._homes.get(key)

    def _count(self, key: int) -> float:
        count, tick = self._counts.get(key, (0.0, self._tick))
        return count * (1.0 - 1.0 / self._window) ** (self._tick - tick)

    def _reweigh(self) -> None:
        """Weigh the busy keys again: every few dozen requests observed, so gateways that observe the same requests
        (their own and their peers') weigh alike at the same moments."""
        self._weighed_at, self._homes = self._tick, None
        busy = {key: count for key in self._counts if (count := self._count(key)) >= BUSY}
        if len(busy) > MAX_TENANTS:
            busy = dict(sorted(busy.items(), key=lambda item: (-item[1], item[0]))[:MAX_TENANTS])
        self._weights = coarse_weights(busy, self._weights)
        light = [busy[key] for key, weight in self._weights.items() if weight == 1.0]
        self.unit = sum(light) / len(light) if light else 0.0
