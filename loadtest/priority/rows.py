"""The benchmark's rows: which gateway settings and replica settings each overload run uses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loadtest.simulator import SimOptions

# Thresholds no fleet reaches: every request goes straight through, first come first served at the replicas.
NO_ADMISSION_FLAGS = ("--saturation-queue", "1000000", "--saturation-kv-cache", "1.0")


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One configuration of gateway and replicas measured under the same overload."""

    key: str
    title: str
    policy: str = "cache-aware"
    admission: bool = True
    upstream_priority: bool = False  # kvgate sets vLLM's `priority`; the replicas order their queue by it
    bound_in_flight: bool = False  # saturated at max_num_seqs requests in flight per replica, whatever scrapes say

    def gateway_flags(self, sim: SimOptions) -> list[str]:
        """`kvgate serve` flags of this row in front of replicas run with `sim`, besides listen and endpoints."""
        flags = ["--policy", self.policy]
        if not self.admission:
            flags += NO_ADMISSION_FLAGS
        elif self.bound_in_flight:
            flags += ["--saturation-in-flight", str(sim.max_num_seqs)]
        if self.upstream_priority:
            flags += ["--upstream-priority", "true"]
        return flags

    def sim_options(self, base: SimOptions) -> SimOptions:
        """Replica settings of this row: `base`, with priority scheduling when kvgate sends priorities."""
        return dataclasses.replace(base, priority_scheduling=self.upstream_priority)


ADMISSION = RowSpec("a", "cache-aware + admission control")
FIFO = RowSpec("b", "cache-aware, FIFO (no admission control)", admission=False)
ROUND_ROBIN_FIFO = RowSpec("c", "round-robin, FIFO (no admission control)", policy="round-robin", admission=False)
UPSTREAM_PRIORITY = RowSpec("d", "cache-aware + admission control + upstream priority", upstream_priority=True)
BOUNDED_IN_FLIGHT = RowSpec("e", "as (d), and at most max_num_seqs in flight per replica", upstream_priority=True,
                            bound_in_flight=True)

ROWS = {row.key: row for row in (ADMISSION, FIFO, ROUND_ROBIN_FIFO, UPSTREAM_PRIORITY, BOUNDED_IN_FLIGHT)}
