"""Tenant placement every gateway computes alike: each busy placement key (a tenant's system prompt) gets one home.

Rendezvous hashing alone gives a tenant a home every gateway agrees on, but homes land unevenly (24 tenants on
three replicas hash about 10 / 8 / 6), and the load bound then spills a share of a busy home's new
conversations, each gateway by its own counts: a spilled tenant is cached on two replicas and its conversations
miss each other's system prompt. Instead, the recently busy keys are assigned whole, as a bin packing every
gateway can repeat from what it sees:

- each key's popularity is its share of the gateway's recent requests (decayed over the load bound's window);
- weights are coarse, so that noise does not reorder or resize tenants: a key under twice the mean of the busy
  keys weighs one, a hotter one the nearest power of two of its ratio to the mean;
- keys go heaviest first (ties by hash), each to the first replica in its own rendezvous order whose assigned
  weight stays within a fair share of the total, or to the least loaded when none has room.

The result is a pure function of the busy keys, their coarse weights and the replica set, recomputed every
few dozen requests: gateways behind a round-robin front see the same tenants at the same shares, so they hold
the same map without talking. A key seen once is no tenant (a one-off prompt); it keeps its rendezvous home.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvgate.endpoints.types import EndpointState
from kvgate.policies.rendezvous import rendezvous_weight

BUSY = 1.5  # decayed requests a key needs to be placed as a tenant: seen at least twice lately
HOT = 2.0  # a key this many times the mean busy key's requests weighs more than one
REFRESH_SHARE = 8  # the map is recomputed after 1/REFRESH_SHARE of the window's requests
MAX_TENANTS = 256  # the busiest keys placed as tenants; lighter ones keep their rendezvous home
MAX_TRACKED = 1024  # keys whose popularity is followed (the lightest are dropped beyond twice this)


def coarse_weights(counts: dict[int, float]) -> dict[int, int]:
    """Each busy key's weight: 1 under `HOT` x the mean count, else the nearest power of two of its ratio."""
    if not counts:
        return {}
    mean = sum(counts.values()) / len(counts)
    return {key: 1 if count < HOT * mean else 2 ** round(math.log2(count / mean)) for key, count in counts.items()}


def assign(weights: dict[int, int], replicas: Sequence[str]) -> dict[int, str]:
    """Heaviest key first, each to the first replica in its rendezvous order with room for it within a fair share
    (half a unit of rounding allowed), else to the least loaded replica; ties by key."""
    fair = sum(weights.values()) / len(replicas)
    load = dict.fromkeys(replicas, 0)
    homes: dict[int, str] = {}
    for key in sorted(weights, key=lambda k: (-weights[k], k)):
        weight = weights[key]
        order = sorted(replicas, key=lambda replica: (-rendezvous_weight(key, replica), replica))
        home = next((replica for replica in order if load[replica] + weight <= fair + 0.5),
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
        self._homes: dict[int, str] = {}
        self._replicas: tuple[str, ...] = ()
        self._refreshed_at = 0

    def observe(self, key: int, window: int) -> None:
        """One more request with this placement key; popularity decays over `window` requests."""
        self._window = window
        self._tick += 1
        self._counts[key] = (self._count(key) + 1.0, self._tick)
        if len(self._counts) > 2 * MAX_TRACKED:
            busiest = sorted(self._counts, key=self._count, reverse=True)[:MAX_TRACKED]
            self._counts = {key: self._counts[key] for key in busiest}

    def home(self, key: int, candidates: Sequence[EndpointState]) -> str | None:
        """The replica the key is assigned to among the candidates; None for a key that is no busy tenant."""
        replicas = tuple(sorted(state.key for state in candidates))
        if replicas != self._replicas or self._tick - self._refreshed_at >= self._window / REFRESH_SHARE:
            self._refresh(replicas)
        return self._homes.get(key)

    def _count(self, key: int) -> float:
        count, tick = self._counts.get(key, (0.0, self._tick))
        return count * (1.0 - 1.0 / self._window) ** (self._tick - tick)

    def _refresh(self, replicas: tuple[str, ...]) -> None:
        self._replicas, self._refreshed_at = replicas, self._tick
        busy = {key: count for key in self._counts if (count := self._count(key)) >= BUSY}
        if len(busy) > MAX_TENANTS:
            busy = dict(sorted(busy.items(), key=lambda item: (-item[1], item[0]))[:MAX_TENANTS])
        self._homes = assign(coarse_weights(busy), replicas) if replicas else {}
