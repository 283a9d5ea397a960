"""The live fleet: discovery's endpoints joined with scraped metrics, served models and in-flight counts."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from kvgate.endpoints.health import PassiveHealth
from kvgate.endpoints.types import Endpoint, EndpointState, FleetSnapshot, ReplicaMetrics
from kvgate.policies.capacity import PromptTokens, SeatLearner, peer_seats
from kvgate.policies.config import RoutingConfig
from kvgate.policies.cost import prompt_tokens
from kvgate.policies.held_kv import HeldKv, kv_footprint
from kvgate.policies.token_rate import PromptTokenRates, fleet_rate
from kvgate.policies.traffic_view import TrafficView
from kvgate.policies.types import RequestInfo

log = logging.getLogger(__name__)

EndpointsListener = Callable[[Sequence[Endpoint]], None]
RemovalListener = Callable[[str], None]
_REUSE_S = 0.005


class Fleet:
    """Keeps the current endpoint set and hands out immutable snapshots of it for routing."""

    def __init__(self, metrics: Callable[[str], ReplicaMetrics], models: Callable[[str], frozenset[str]],
                 clock: Callable[[], float] = time.monotonic, seats: int = 0, kv_full: float = 0.8,
                 peers: bool = False, routing: RoutingConfig | None = None) -> None:
        self._metrics = metrics
        self._routing = routing or RoutingConfig()
        self._models = models
        self.health = PassiveHealth(clock=clock)
        self._clock = clock
        self._version = 0  # bumped by every change a snapshot shows at once (endpoints, counts, scrapes)
        self._cached: tuple[tuple[int, int], FleetSnapshot] | None = None
        self._endpoints: dict[str, Endpoint] = {}
        self._in_flight: Counter[str] = Counter()
        self._recent: Counter[str] = Counter()  # sent - finished since each replica's last successful scrape
        self._sends: Counter[str] = Counter()  # requests ever sent to each replica
        self._sends_at_scrape: dict[str, int] = {}  # _sends when the scrape in flight started
        self._open_at_scrape: dict[str, int] = {}  # _in_flight when the scrape in flight started
        self._open_at_page: dict[str, int] = {}  # _in_flight when the last successful scrape started
        self._held: dict[str, HeldKv] = {}  # KV cache this gateway's in-flight requests hold on each replica
        self._held_at_scrape: dict[str, float] = {}  # _held's tokens when the scrape in flight started
        self._held_at_page: dict[str, float] = {}  # _held's tokens when the last successful scrape started
        self._elsewhere: Counter[str] = Counter()  # requests other gateways sent since each replica's last scrape
        self._elsewhere_at_scrape: dict[str, int] = {}  # _elsewhere when the scrape in flight started
        self._configured_seats = seats  # every replica's --max-num-seqs when the operator gave it; 0 = learn
        self._seats = SeatLearner(kv_full)
        self._token_rates = PromptTokenRates()
        self._traffic = TrafficView(peers)  # peers: gateways sharing their decisions with this one
        self._set_listeners: list[EndpointsListener] = []
        self._removal_listeners: list[RemovalListener] = []

    def on_endpoints(self, listener: EndpointsListener) -> None:
        """Call `listener` with the full endpoint list whenever discovery changes it."""
        self._set_listeners.append(listener)

    def on_removed(self, listener: RemovalListener) -> None:
        """Call `listener` with the key of every endpoint that leaves the fleet."""
        self._removal_listeners.append(listener)

    def apply(self, endpoints: Sequence[Endpoint]) -> None:
        """Replace the endpoint set with discovery's latest report."""
        new = {e.key: e for e in endpoints}
        removed = self._endpoints.keys() - new.keys()
        for key in sorted(new.keys() - self._endpoints.keys()):
            log.info("endpoint added key=%s url=%s accepting=%s", key, new[key].url, new[key].accepting)
        for key, endpoint in new.items():
            old = self._endpoints.get(key)
            if old is not None and old != endpoint:
                log.info("endpoint changed key=%s url=%s accepting=%s", key, endpoint.url, endpoint.accepting)
        self._endpoints = new
        self._version += 1
        for key in sorted(removed):
            log.info("endpoint removed key=%s", key)
            self.health.forget(key)
            self._recent.pop(key, None)
            self._sends.pop(key, None)
            self._sends_at_scrape.pop(key, None)
            self._open_at_scrape.pop(key, None)
            self._open_at_page.pop(key, None)
            for kept in (self._held, self._held_at_scrape, self._held_at_page, self._elsewhere,
                         self._elsewhere_at_scrape):
                kept.pop(key, None)
            self._seats.forget(key)
            self._token_rates.forget(key)
            self._traffic.forget(key)
            for listener in self._removal_listeners:
                listener(key)
        for set_listener in self._set_listeners:
            set_listener(list(new.values()))

    @property
    def endpoints(self) -> list[Endpoint]:
        """The endpoints discovery reports now, accepting or not."""
        return list(self._endpoints.values())

    def snapshot(self) -> FleetSnapshot:
        """An immutable view of every endpoint with its metrics, models and in-flight count.

        One request asks for it more than once (admission, then the pick) and a queue dispatching many
        asks in a row: a view is reused while nothing it shows changed and it is under _REUSE_S old
        (time-driven changes, staleness by age and breakers reopening, are slower than that).
        """
        version = (self._version, self.health.version)
        now = self._clock()
        if self._cached is not None and self._cached[0] == version and now - self._cached[1].now < _REUSE_S:
            return self._cached[1]
        models = {key: self._models(key) for key in self._endpoints}
        learned: Mapping[str, int] = {} if self._configured_seats else self._seats.learned()
        peers = peer_seats(learned, models) if learned else {}
        filled = self._seats.filled()
        states = tuple(self._state(key, endpoint, models[key], learned.get(key), peers.get(key), key in filled)
                       for key, endpoint in self._endpoints.items())
        snapshot = FleetSnapshot(endpoints=states, now=now, partial_view=self._traffic.partial())
        self._cached = (version, snapshot)
        return snapshot

    def _state(self, key: str, endpoint: Endpoint, models: frozenset[str], learned_seats: int | None,
               seats_of_peers: int | None, filled: bool) -> EndpointState:
        metrics = self._metrics(key)
        return EndpointState(endpoint=endpoint, metrics=metrics, in_flight=self._in_flight[key], models=models,
                             healthy=self.health.healthy(key), recent=self._recent[key],
                             grown=self._in_flight[key] - self._open_at_page.get(key, 0),
                             kv_grown=self._held_tokens(key) - self._held_at_page.get(key, 0.0),
                             elsewhere=self._elsewhere[key],
                             seats=self._configured_seats or learned_seats, peer_seats=seats_of_peers,
                             filled=filled, chars_per_token=self._token_rates.rate(key))

    def routable_count(self) -> int:
        """How many endpoints may take new requests."""
        return sum(1 for e in self._endpoints.values() if e.accepting)

    def scrape_started(self, key: str) -> None:
        """A scrape of `key` starts: what was sent and finished before now is in the page it will read."""
        self._sends_at_scrape[key] = self._sends[key]
        self._open_at_scrape[key] = self._in_flight[key]
        self._held_at_scrape[key] = self._held_tokens(key)
        self._elsewhere_at_scrape[key] = self._elsewhere[key]

    def scraped(self, key: str, ok: bool) -> None:
        """A scrape of `key` finished: a fresh one already counts what was sent and finished before it started.

        What happened while it was in flight may or may not be in the page: requests sent then still
        count as sent (perhaps twice), requests finished then as finished before it (perhaps early), so
        the estimate of what the replica holds errs high, never low.
        """
        self._version += 1  # new metrics, and staleness may have changed
        started_at = self._sends_at_scrape.pop(key, self._sends[key])
        open_at_start = self._open_at_scrape.pop(key, self._in_flight[key])
        held_at_start = self._held_at_scrape.pop(key, self._held_tokens(key))
        elsewhere_at_start = self._elsewhere_at_scrape.pop(key, self._elsewhere[key])
        if ok:
            self._recent[key] = self._sends[key] - started_at
            self._open_at_page[key] = open_at_start
            self._held_at_page[key] = held_at_start
            self._elsewhere[key] -= elsewhere_at_start
            metrics = self._metrics(key)
            learned = self._seats.observe(key, metrics)
            if learned is not None:
                log.info("replica seats learned key=%s seats=%d", key, learned)
            self._token_rates.scraped(key, metrics.finished_requests, metrics.finished_prompt_tokens)
            self._follow_traffic(key, metrics, open_at_start)

    def _follow_traffic(self, key: str, metrics: ReplicaMetrics, open_requests: int) -> None:
        """Count the replica's requests against those this gateway knows of; log when the view changes."""
        was = self._traffic.partial()
        self._traffic.scraped(key, metrics.finished_requests, metrics.running + metrics.waiting, open_requests)
        if self._traffic.partial() != was:
            log.info("routing view changed partial=%s seen_share=%.2f", not was, self._traffic.seen_share() or 0.0)

    def seen_share(self) -> float | None:
        """The share of its replicas' requests this gateway sent or learned of (TrafficView); None until known."""
        return self._traffic.seen_share()

    def acquire(self, key: str, request: RequestInfo | None = None) -> None:
        """Count a request sent to `key` (at pick time, so the next pick sees it), and the KV cache its prompt takes
        there (`request`; None: unknown)."""
        self._in_flight[key] += 1
        if request is not None:
            self._held.setdefault(key, HeldKv()).add(kv_footprint(request, self._routing))
        self._sent(key)

    def sent_elsewhere(self, key: str) -> None:
        """Count a request another gateway sent to `key`: it is on the replica, as one of this gateway's would be,
        until a scrape shows it (its finish is not seen here, so the estimate errs high until then). Not while the
        replica's metrics are stale: no scrape would reset the count."""
        if not self._metrics(key).stale:
            self._elsewhere[key] += 1
            self._sent(key)

    def _sent(self, key: str) -> None:
        """One more request on `key` since its last scrape."""
        self._recent[key] += 1
        self._sends[key] += 1
        self._traffic.sent(key)
        self._version += 1

    def release(self, key: str, request: RequestInfo | None = None) -> None:
        """Count a request to `key` as finished (`request` as acquire() was given it)."""
        held = self._held.get(key)
        if request is not None and held is not None:
            held.remove(kv_footprint(request, self._routing))
        self._in_flight[key] -= 1
        self._recent[key] -= 1
        self._version += 1
        if self._in_flight[key] <= 0:
            del self._in_flight[key]

    def answered(self, key: str, prompt_chars: int) -> None:
        """`key` answered a request whose prompt was `prompt_chars` characters to the end (PromptTokenRates)."""
        self._token_rates.answered(key, prompt_chars)

    def chars_per_token(self, model: str) -> float | None:
        """Prompt characters per token on the replicas serving `model` (the median of those learned); None until
        one is."""
        return fleet_rate(state.chars_per_token for state in self.snapshot().endpoints if state.serves(model))

    def prompt_tokens(self, request: RequestInfo) -> PromptTokens:
        """The KV cache tokens `request`'s prompt takes on each replica: less where requests in flight hold its
        leading blocks already (HeldKv.shared_tokens)."""
        footprint, whole = kv_footprint(request, self._routing), prompt_tokens(request, self._routing)
        return PromptTokens(whole, {key: max(1, math.ceil(whole - held.shared_tokens(footprint)))
                                    for key, held in self._held.items()})

    def freed_by(self, key: str, requests: Sequence[RequestInfo]) -> float:
        """The KV cache tokens `key` frees once these of this gateway's requests on it end (HeldKv.freed_by)."""
        held = self._held.get(key)
        if held is None:
            return 0.0
        return held.freed_by([kv_footprint(request, self._routing) for request in requests])

    def _held_tokens(self, key: str) -> float:
        held = self._held.get(key)
        return held.tokens if held is not None else 0.0

    def in_flight(self, key: str) -> int:
        """Requests this gateway has open on `key`."""
        return self._in_flight[key]
