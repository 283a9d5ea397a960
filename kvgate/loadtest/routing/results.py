"""What a benchmark run measured, before any summarising: the rows planned and their raw results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvgate.loadtest.kit.replicas import LoadSeries
from kvgate.loadtest.kit.stream import RequestSample
from kvgate.simulator import SimOptions

ORACLE = "oracle"
PRESSURE_ORACLE = "pressure oracle"  # one replica with the whole fleet's cache (precise routing's ceiling)
KVGATE = "kvgate"
EXTERNAL = "external"
BASELINE_POLICY = "round-robin"


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One row of a scenario: what routes the traffic."""

    name: str
    kind: str  # ORACLE (straight to one unbounded replica), KVGATE or EXTERNAL
    policy: str | None = None  # kvgate policy
    gateways: int = 1  # kvgate processes sharing the traffic by client-side round robin
    template: str | None = None  # external router command line
    precise: bool = False  # kvgate routes on the replicas' KV events (tokenizing as they do)

    @property
    def is_baseline(self) -> bool:
        """Whether this is the round-robin row every other row is compared with."""
        return self.kind == KVGATE and self.policy == BASELINE_POLICY and self.gateways == 1


@dataclass(slots=True)
class RowRun:
    """The raw outcome of one row: client samples, the replicas' counters, their load over time."""

    plan: RowPlan
    samples: list[RequestSample] = field(default_factory=list)
    replica_stats: list[dict[str, Any]] = field(default_factory=list)
    load: LoadSeries = field(default_factory=LoadSeries)
    wall_seconds: float = 0.0
    error: str | None = None  # set when the row could not run at all
    decisions: dict[str, int] = field(default_factory=dict)  # kvgate rows: routing decisions by reason

    def replica_total(self, counter: str) -> int:
        """A `/sim/stats` counter summed over the row's replicas."""
        return sum(int(stats[counter]) for stats in self.replica_stats)

    @property
    def hit_rate(self) -> float | None:
        """Prefix cache hits over queries, in tokens, by the replicas' own counters; None without queries."""
        queries = self.replica_total("prefix_cache_queries")
        return self.replica_total("prefix_cache_hits") / queries if queries else None

    @property
    def errors(self) -> int:
        """Requests that failed or ended without completing."""
        return sum(sample.error is not None for sample in self.samples)


@dataclass(slots=True)
class ScenarioRun:
    """Every row of one load (uniform or Zipf chats, shared prefix, ...), each measured `runs` times in turn."""

    name: str
    description: str
    skewed: bool  # popularity is skewed: the balance targets apply
    fleet: SimOptions | None = None  # the simulated fleet's and the oracle's settings (None on real engines)
    oracle: SimOptions | None = None
    rows: list[RowRun] = field(default_factory=list)
