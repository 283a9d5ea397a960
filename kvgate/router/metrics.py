"""The gateway's own Prometheus metrics, in a registry per gateway instance."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily
from prometheus_client.registry import Collector

from kvgate.endpoints.discovery import DiscoveryStatus
from kvgate.endpoints.kv_events import ReplicaEventStats
from kvgate.endpoints.types import EndpointState
from kvgate.policies.precise_index import PrecisePrefixIndex

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
# The label names of the series kept per replica (dropped when the replica leaves the fleet).
REQUESTS_LABELS = ("route", "model", "status", "replica")
IN_FLIGHT_LABELS = ("replica",)
UPSTREAM_ERRORS_LABELS = ("kind", "replica")
NO_REPLICA = "-"  # the replica label of requests answered without one (refused, queued out, shed)


class GatewayMetrics:
    """Every metric kvgate exports about itself."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvgate_requests", "Requests answered, by route, model, status and replica",
                                REQUESTS_LABELS, registry=r)
        self.in_flight = Gauge("kvgate_requests_in_flight", "Requests being proxied now, by replica",
                               IN_FLIGHT_LABELS, registry=r)
        self.ttfb = Histogram("kvgate_time_to_first_byte_seconds",
                              "From request arrival to the first response byte from the replica",
                              ["route", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("kvgate_request_duration_seconds", "From request arrival to the last byte sent",
                                  ["route", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter("kvgate_upstream_errors", "Failures talking to replicas, by kind",
                                       UPSTREAM_ERRORS_LABELS, registry=r)
        self.retries = Counter("kvgate_retries", "Requests retried on another replica, by cause",
                               ["cause"], registry=r)
        self.decisions = Counter("kvgate_routing_decisions", "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.overflows = Counter("kvgate_routing_overflows", "Requests moved off the replica holding their context "
                                 "or assigned their prefix, by policy and what moved them (a filter, or cost)",
                                 ["policy", "moved_by"], registry=r)
        self.matched_fraction = Histogram("kvgate_prefix_match_fraction",
                                          "Share of a request's prefix blocks the chosen replica is believed to hold",
                                          buckets=_FRACTION_BUCKETS, registry=r)
        self.rejected = Counter("kvgate_rejected_requests", "Requests answered by the gateway itself with an error",
                                ["status", "param"], registry=r)
        self.auth_failures = Counter("kvgate_auth_failures", "Requests refused with 401, by reason (missing, invalid)",
                                     ["reason"], registry=r)
        self.peer_decisions = Counter("kvgate_peer_decisions", "Routing decisions shared with the other gateway "
                                      "replicas, by event (published, dropped, learned, unknown_replica, invalid)",
                                      ["event"], registry=r)
        self.picker_messages = Counter("kvgate_picker_messages", "ext_proc messages the endpoint picker received, by "
                                       "kind (request_headers, request_body, response_headers, ...)", ["kind"],
                                       registry=r)

        self.queue_depth = Gauge("kvgate_admission_queue_depth", "Requests waiting in the gateway, by class",
                                 ["priority_class"], registry=r)
        self.queue_wait = Histogram("kvgate_admission_wait_seconds", "Time requests waited in the gateway, by class",
                                    ["priority_class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.admitted = Counter("kvgate_admission_dispatched", "Requests let through, directly or after queueing",
                                ["priority_class", "path"], registry=r)
        self.shed = Counter("kvgate_admission_shed", "Requests shed with 429, by class and reason",
                            ["priority_class", "reason"], registry=r)
        self.queue_abandoned = Counter("kvgate_admission_abandoned", "Clients that left while queued",
                                       ["priority_class"], registry=r)
        self.preempted = Counter("kvgate_admission_preempted", "Requests that gave up their seat to a more important "
                                 "one before their replica answered, and queued again", ["priority_class"], registry=r)

    def keep_replicas(self, replicas: Collection[str]) -> None:
        """Drop the series of replicas no longer in the fleet: pods come and go, and their series would pile up.

        A request still open on a departed replica when it leaves may bring its series back when it ends; the
        next change of the fleet drops it again.
        """
        for metric, names in ((self.requests, REQUESTS_LABELS), (self.in_flight, IN_FLIGHT_LABELS),
                              (self.upstream_errors, UPSTREAM_ERRORS_LABELS)):
            departed = {tuple(sample.labels[name] for name in names)
                        for family in metric.collect() for sample in family.samples
                        if sample.labels["replica"] not in replicas and sample.labels["replica"] != NO_REPLICA}
            for labels in departed:
                metric.remove(*labels)

    def add_collector(self, collector: Collector) -> None:
        """Register a collector that reads live state at scrape time."""
        self.registry.register(collector)


class FleetCollector(Collector):
    """Reads discovery health, endpoint counts, scrape staleness and prefix index size at scrape time."""

    def __init__(self, discovery: Callable[[], DiscoveryStatus], endpoint_states: Callable[[], Iterable[EndpointState]],
                 index_blocks: Callable[[], int], index_bytes: Callable[[], int],
                 seen_share: Callable[[], float | None]) -> None:
        self._discovery = discovery
        self._seen_share = seen_share
        self._endpoint_states = endpoint_states
        self._index_blocks = index_blocks
        self._index_bytes = index_bytes

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Yield the live gauges."""
        status = self._discovery()
        yield GaugeMetricFamily("kvgate_discovery_healthy", "1 while discovery reaches its source", value=int(status.healthy))
        yield CounterMetricFamily("kvgate_discovery_watch_restarts", "Watch streams restarted", value=status.restarts)
        yield CounterMetricFamily("kvgate_discovery_relists", "Full re-lists after the first", value=status.relists)
        age = GaugeMetricFamily("kvgate_discovery_last_event_age_seconds", "Seconds since the last discovery event")
        if status.last_event_at is not None:
            age.add_metric([], time.monotonic() - status.last_event_at)
        yield age
        endpoints = GaugeMetricFamily("kvgate_endpoints", "Known replicas by state", labels=["state"])
        stale = GaugeMetricFamily("kvgate_replica_metrics_stale", "1 when a replica's scraped metrics are stale",
                                  labels=["replica"])
        seats = GaugeMetricFamily("kvgate_replica_seats", "Sequences a replica runs at once, configured or learned "
                                  "(0 while unknown)", labels=["replica"])
        rates = GaugeMetricFamily("kvgate_replica_chars_per_token", "Prompt characters per token a replica's engine "
                                  "counted (absent until learned)", labels=["replica"])
        counts = {"accepting": 0, "not_accepting": 0}
        for state in self._endpoint_states():
            counts["accepting" if state.endpoint.accepting else "not_accepting"] += 1
            stale.add_metric([state.key], int(state.metrics.stale))
            seats.add_metric([state.key], state.seats or 0)
            if state.chars_per_token is not None:
                rates.add_metric([state.key], state.chars_per_token)
        for state, count in counts.items():
            endpoints.add_metric([state], count)
        yield endpoints
        yield stale
        yield seats
        yield rates
        yield GaugeMetricFamily("kvgate_prefix_index_blocks", "Prefix blocks held in the index, all replicas",
                                value=self._index_blocks())
        yield GaugeMetricFamily("kvgate_prefix_index_bytes", "Estimated memory of the prefix index",
                                value=self._index_bytes())
        seen = GaugeMetricFamily("kvgate_traffic_seen_ratio", "Requests this gateway sent or learned from peers over "
                                 "the requests its replicas finished (before 64 have: requests open over requests "
                                 "held; absent until known)")
        share = self._seen_share()
        if share is not None:
            seen.add_metric([], share)
        yield seen


class KvEventsCollector(Collector):
    """Reads each replica's KV events subscription and the precise index at scrape time."""

    def __init__(self, stats: Callable[[], Mapping[str, ReplicaEventStats]], index: PrecisePrefixIndex) -> None:
        self._stats = stats
        self._index = index

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Yield per-replica event counters and precise-state gauges, and the index's size."""
        families = {
            "events": CounterMetricFamily("kvgate_kv_events_received", "KV cache events received, by replica",
                                          labels=["replica"]),
            "gaps": CounterMetricFamily("kvgate_kv_events_gaps", "Sequence gaps in a replica's KV events",
                                        labels=["replica"]),
            "restarts": CounterMetricFamily("kvgate_kv_events_restarts", "KV event sequences that started again "
                                            "(engine restarts)", labels=["replica"]),
            "replays": CounterMetricFamily("kvgate_kv_events_replays", "Replays requested from a replica",
                                           labels=["replica"]),
            "replay_failures": CounterMetricFamily("kvgate_kv_events_replay_failures", "Replays that could not "
                                                   "fill what was missing", labels=["replica"]),
        }
        precise = GaugeMetricFamily("kvgate_kv_events_precise", "1 while a replica is routed on its KV events, "
                                    "0 while it is routed approximately", labels=["replica"])
        held = GaugeMetricFamily("kvgate_kv_events_blocks_held", "KV blocks a replica holds according to its events",
                                 labels=["replica"])
        for key, stats in self._stats().items():
            for name, family in families.items():
                family.add_metric([key], getattr(stats, name))
            precise.add_metric([key], int(self._index.is_precise(key)))
            held.add_metric([key], self._index.blocks_held(key))
        yield from families.values()
        yield precise
        yield held
        yield GaugeMetricFamily("kvgate_precise_index_bytes", "Estimated memory of the precise prefix index",
                                value=self._index.approx_bytes)
        yield CounterMetricFamily("kvgate_precise_index_dropped_blocks", "Stored blocks refused by the index's bound",
                                  value=self._index.dropped_blocks)
