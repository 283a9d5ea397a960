"""The benchmark's rows: which gateway settings and replica settings each overload run uses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvgate.simulator import SimOptions

# Thresholds no fleet reaches: every request goes straight through, first come first served at the replicas.
NO_ADMISSION_FLAGS = ("--saturation-queue", "1000000", "--saturation-seated-queue", "1000000",
                      "--saturation-kv-cache", "1.0", "--admission-reserve", "batch=0", "--admission-preemptible", "")


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One configuration of gateway and replicas measured under the same overload."""

    key: str
    title: str
    policy: str = "cache-aware"
    admission: bool = True
    upstream_priority: bool = True  # kvgate sets vLLM's `priority`; the replicas order their queue by it
    seats_learned: bool = False  # kvgate learns the replicas' max_num_seqs from /metrics instead of being told it
    no_config: bool = False  # `kvgate serve --endpoints ...` and nothing else: kvgate's defaults, seats learned
    batch_stream: bool = False  # batch requests stream (so kvgate cannot preempt them) instead of reading whole answers

    def gateway_flags(self, sim: SimOptions) -> list[str]:
        """`kvgate serve` flags of this row in front of replicas run with `sim`, besides listen and endpoints."""
        if self.no_config:
            return []
        flags = ["--policy", self.policy]
        if not self.admission:
            flags += NO_ADMISSION_FLAGS
        elif not self.seats_learned:  # as the manifests in deploy/ do
            flags += ["--saturation-seats", str(sim.max_num_seqs)]
        if self.upstream_priority:
            flags += ["--upstream-priority", "true"]
        return flags

    def sim_options(self, base: SimOptions) -> SimOptions:
        """Replica settings of this row: `base`, with priority scheduling when kvgate sends priorities."""
        return dataclasses.replace(base, priority_scheduling=self.upstream_priority)


ADMISSION = RowSpec("a", "cache-aware + admission control as deploy/ ships it: max_num_seqs configured, "
                              "upstream priority")
FIFO = RowSpec("b", "cache-aware, FIFO (no admission control)", admission=False, upstream_priority=False)
ROUND_ROBIN_FIFO = RowSpec("c", "round-robin, FIFO (no admission control)", policy="round-robin", admission=False,
                           upstream_priority=False)
NO_UPSTREAM_PRIORITY = RowSpec("d", "as (a), replicas first come first served (no upstream priority)",
                               upstream_priority=False)
SEATS_LEARNED = RowSpec("e", "as (a), with max_num_seqs learned from /metrics instead of configured",
                        seats_learned=True)
BATCH_STREAMED = RowSpec("f", "as (a), with batch requests streamed: not preemptible, they leave a reserve",
                         batch_stream=True)

NO_CONFIG_STREAMED = RowSpec("g", "kvgate with no configuration (defaults, seats learned, replicas first come "
                             "first served), batch streamed", upstream_priority=False, no_config=True, batch_stream=True)
NO_CONFIG_WHOLE = RowSpec("h", "kvgate with no configuration, batch reading whole answers", upstream_priority=False,
                          no_config=True)

ROWS = {row.key: row for row in (ADMISSION, FIFO, ROUND_ROBIN_FIFO, NO_UPSTREAM_PRIORITY, SEATS_LEARNED,
                                 BATCH_STREAMED, NO_CONFIG_STREAMED, NO_CONFIG_WHOLE)}
