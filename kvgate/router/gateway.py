"""The gateway's parts and their lifecycle: discovery, scraping, the fleet, admission, the policy and the proxy."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from aiohttp import web

from kvgate.endpoints.discovery import Discovery, StaticDiscovery, parse_endpoint_urls
from kvgate.endpoints.fleet import Fleet
from kvgate.endpoints.kv_events import KvEventAddresses, KvEventSubscriber, ReplicaEventStats
from kvgate.endpoints.model_lister import ModelLister
from kvgate.endpoints.scraper import MetricsScraper
from kvgate.endpoints.types import Endpoint, EndpointState
from kvgate.engine.tokenizer import TokenizerError
from kvgate.policies import build_policy
from kvgate.policies.capacity import ClassStanding, occupied, room_for, with_room
from kvgate.policies.cost import prompt_tokens
from kvgate.policies.precise_index import PrecisePrefixIndex
from kvgate.policies.types import Policy, RequestInfo
from kvgate.router.admission import AdmissionQueue
from kvgate.router.auth import CREDENTIAL_HEADERS, ApiKeyStore
from kvgate.router.config import ConfigError, GatewayConfig, tokenizer_dirs
from kvgate.router.http_sessions import HttpSessions
from kvgate.router.metrics import FleetCollector, GatewayMetrics, KvEventsCollector
from kvgate.router.peers import PEERS_PORT_NAME, DecisionPeers
from kvgate.router.preemption import PreemptionRegistry
from kvgate.router.proxy import Forwarder, UpstreamTimeouts
from kvgate.router.ratelimit import RateLimiter
from kvgate.router.tokenizing import RequestTokenizer

log = logging.getLogger(__name__)

DiscoveryFactory = Callable[[GatewayConfig], Discovery]


def default_discovery(config: GatewayConfig) -> Discovery:
    """The discovery source the configuration names."""
    if config.discovery == "kubernetes":
        from kvgate.endpoints.kubernetes import EndpointSliceWatcher  # imports the kubernetes client lazily
        from kvgate.endpoints.multi_discovery import MultiDiscovery

        watchers = [EndpointSliceWatcher(config.namespace, service, port_name=config.port_name, port=config.port,
                                         read_timeout_s=config.watch_read_timeout) for service in config.service]
        return watchers[0] if len(watchers) == 1 else MultiDiscovery(watchers)
    if config.discovery == "inferencepool":
        from kvgate.endpoints.inference_pool import InferencePoolWatcher
        from kvgate.endpoints.k8s_watch import WatchSettings

        assert config.pool is not None
        return InferencePoolWatcher(config.namespace, config.pool, WatchSettings(config.watch_read_timeout))
    return StaticDiscovery(parse_endpoint_urls(config.endpoints))


def peer_discovery(config: GatewayConfig) -> Discovery | None:
    """The other gateway replicas' pods, from the EndpointSlices of `peer_service` (port "peers"), if set."""
    if config.peer_service is None:
        return None
    from kvgate.endpoints.kubernetes import EndpointSliceWatcher

    return EndpointSliceWatcher(config.namespace, config.peer_service, port_name=PEERS_PORT_NAME,
                                read_timeout_s=config.watch_read_timeout)


class Gateway:
    """Every long-lived part of one gateway instance, built at construction; run by aiohttp's cleanup_ctx."""

    def __init__(self, config: GatewayConfig, discovery: Discovery) -> None:
        self.config = config
        self.discovery = discovery
        self.draining = False
        self.metrics = GatewayMetrics()
        # Precise routing: what each replica really caches, from its KV events (off without an events address).
        self.precise = PrecisePrefixIndex(config.kv_events_max_blocks, config.kv_events_hold) \
            if config.kv_events_endpoint else None
        self.policy: Policy = build_policy(config.policy, config.routing, self.precise)
        try:  # token ids serve only the precise index
            self.tokenizer = RequestTokenizer.load(tokenizer_dirs(config), config.tokenize_offload_bytes) \
                if config.tokenizer and self.precise is not None else None
        except TokenizerError as exc:
            raise ConfigError(f"tokenizer: {exc}") from None
        # API keys are read at construction so a bad file stops the gateway before it listens.
        self.keys = ApiKeyStore(config.api_keys_file, priority_classes=config.priorities.classes) \
            if config.api_keys_file else None
        self.limiter = RateLimiter()
        self.sessions = HttpSessions()
        self.scraper = MetricsScraper(self.sessions.poll, interval_s=config.scrape_interval,
                                      timeout_s=config.scrape_timeout)
        self.models = ModelLister(self.sessions.poll, refresh_s=config.models_refresh)
        self.fleet = Fleet(self.scraper.metrics, self.models.models, seats=config.saturation.seats,
                           kv_full=config.saturation.kv_cache,
                           peers=config.shares_decisions, routing=config.routing)
        self.preemption = PreemptionRegistry(self._candidates, self.fleet) if config.admission.preemptible else None
        self.admission = AdmissionQueue(config.admission, config.priorities, self._room, self.metrics,
                                        self.preemption, held_with_room=self._held_with_room,
                                        prompt_tokens=functools.partial(prompt_tokens, config=config.routing))
        self.peers = DecisionPeers(config.peer_address, config.peer_addresses, self.routed_elsewhere,
                                   lambda event: self.metrics.peer_decisions.labels(event).inc(),
                                   peer_discovery(config)) \
            if config.shares_decisions else None
        self.forwarder = Forwarder(self.sessions.proxy, self.fleet, self.routed, self.metrics,
                                   UpstreamTimeouts(config.connect_timeout, config.idle_timeout,
                                                    config.request_timeout),
                                   dropped_headers=CREDENTIAL_HEADERS if self.keys else frozenset(),
                                   preemption=self.preemption)
        self.kv_events = self._kv_event_subscriber(self.precise) if self.precise is not None else None
        self.metrics.add_collector(FleetCollector(
            discovery=lambda: self.discovery.status,
            endpoint_states=lambda: self.fleet.snapshot().endpoints,
            index_blocks=lambda: sum(self.policy.index_sizes().values()),
            index_bytes=self.policy.index_bytes,
            seen_share=self.fleet.seen_share,
        ))
        if self.kv_events is not None and self.precise is not None:
            self.metrics.add_collector(KvEventsCollector(self.kv_events.stats, self.precise))
        self.fleet.on_endpoints(self._endpoints_changed)
        self.fleet.on_removed(self.policy.forget)
        self.scraper.add_start_listener(self.fleet.scrape_started)
        self.scraper.add_result_listener(self._scraped)
        self.scraper.add_round_listener(self.admission.refresh)

    def routed(self, request: RequestInfo, chosen: EndpointState) -> None:
        """`request` goes to `chosen`: the policy learns it, and so do the peer gateways."""
        self.policy.record(request, chosen)
        if self.peers is not None:
            self.peers.publish(request, chosen.key)

    def routed_elsewhere(self, request: RequestInfo, replica: str) -> bool:
        """A peer gateway sent `request` to `replica`: the policy learns it as one of its own, and the replica's load
        counts it until the next scrape shows it; False when this gateway does not know the replica."""
        snapshot = self.fleet.snapshot()
        state = snapshot.get(replica)
        if state is None:
            return False
        self.policy.learn(request.at_rate(self.fleet.chars_per_token(request.model)), state, snapshot)
        self.fleet.sent_elsewhere(replica)
        return True

    def _endpoints_changed(self, endpoints: Sequence[Endpoint]) -> None:
        """Discovery changed the replicas: scrape, list and follow the new set, and dispatch what now fits."""
        self.scraper.set_endpoints(endpoints)
        self.metrics.keep_replicas({endpoint.key for endpoint in endpoints})
        self.models.set_endpoints(endpoints)
        if self.kv_events is not None:
            self.kv_events.set_endpoints(endpoints)
        self.admission.refresh()

    def _scraped(self, key: str, ok: bool, _duration: float) -> None:
        """A scrape of `key` ended: the fleet's load estimate and seat count take it in (admission follows on the
        round listener, once every replica's scrape of the round is in)."""
        self.fleet.scraped(key, ok)

    def ready(self) -> tuple[bool, str]:
        """Whether the gateway should receive traffic, and why not."""
        if self.draining:
            return False, "draining"
        if not self.discovery.status.synced:
            return False, "discovery has not listed the replicas yet"
        if self.fleet.routable_count() == 0:
            return False, "no routable replica"
        return True, "ok"

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup_ctx: open the HTTP sessions and start the background tasks, then stop both after the drain."""
        if self.config.discovery in ("kubernetes", "inferencepool") or self.config.peer_service:
            from kvgate.endpoints.kubernetes import load_kubernetes_config

            await load_kubernetes_config()
        if self.peers is not None:
            self.peers.open()
        async with self.sessions.opened():
            tasks = [asyncio.create_task(coro, name=name) for name, coro in (
                ("discovery", self.discovery.run(self.fleet.apply)),
                ("scraper", self.scraper.run()),
                ("models", self.models.run()),
                *((("api-keys", self.keys.run()),) if self.keys else ()),
                *((("peers", self.peers.run()),) if self.peers else ()),
            )]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if self.kv_events is not None:
                    await self.kv_events.close()
                if self.peers is not None:
                    self.peers.close()

    def _kv_event_subscriber(self, precise: PrecisePrefixIndex) -> KvEventSubscriber:
        """Follows every replica's KV events; a replica whose connection drops loses the approximate belief too."""
        config, scraper = self.config, self.scraper
        return KvEventSubscriber(
            precise, KvEventAddresses.parse(config.kv_events_endpoint, "kv_events_endpoint"),
            KvEventAddresses.parse(config.kv_events_replay_endpoint, "kv_events_replay_endpoint"),
            topic=config.kv_events_topic, replay_timeout_s=config.kv_events_replay_timeout, bind=config.kv_events_bind,
            capacity_blocks=lambda key: scraper.metrics(key).num_gpu_blocks, on_lost=self.policy.forget)

    def _candidates(self, model: str) -> tuple[EndpointState, ...]:
        """The replicas that may take a request for `model` now."""
        return self.fleet.snapshot().candidates(model)

    def _room(self, request: RequestInfo, standing: ClassStanding) -> float:
        """Requests like `request`, of a class so standing, that its model's replicas take now (the capacity
        model's answer). A class that probes never counts KV blocks, so its prompt's need per replica is not built."""
        tokens = 0 if standing.probes else self.fleet.prompt_tokens(request)
        return room_for(self._candidates(request.model), self.config.saturation, standing, tokens)

    def _held_with_room(self, request: RequestInfo, standing: ClassStanding) -> bool:
        """Whether a replica with room for `request`, of a class so standing, holds more of its prompt than the
        least of its model's replicas."""
        snapshot = self.fleet.snapshot()
        candidates = snapshot.candidates(request.model)
        holders = self.policy.holders(request, candidates, snapshot.now)
        return bool(holders) and bool(with_room(candidates, self.config.saturation, standing,
                                                self.fleet.prompt_tokens(request), holders))

    def _describe_events(self, key: str, stats: ReplicaEventStats | None) -> dict[str, Any] | None:
        """One replica's KV events subscription for /debug/fleet; None when it has no events address."""
        if stats is None or self.precise is None:
            return None
        return {**dataclasses.asdict(stats), **self.precise.describe(key)}

    def serves(self, model: str) -> bool:
        """Whether some replica reports serving `model`."""
        return self.models.serves(model)

    def models_known(self) -> bool:
        """Whether every endpoint's model list is known, so an unlisted model is truly unknown."""
        endpoints = self.fleet.endpoints
        return bool(endpoints) and all(self.models.models(e.key) for e in endpoints)

    def describe(self) -> dict[str, Any]:
        """The /debug/fleet view: replicas, scraped metrics and staleness, the policy's index, discovery."""
        snapshot = self.fleet.snapshot()
        index = self.policy.index_sizes()
        events = self.kv_events.stats() if self.kv_events is not None else {}
        endpoints = []
        for state in snapshot.endpoints:
            metrics = state.metrics
            endpoints.append({
                "key": state.key, "url": state.endpoint.url, "pool": state.endpoint.pool,
                "accepting": state.endpoint.accepting, "in_flight": state.in_flight,
                "seats": state.seats, "peer_seats": state.peer_seats, "filled": state.filled,
                "chars_per_token": None if state.chars_per_token is None else round(state.chars_per_token, 3),
                "occupied": occupied(state),
                "models": sorted(state.models), "index_blocks": index.get(state.key, 0),
                "routing": "precise" if self.precise is not None and self.precise.is_precise(state.key)
                else "approximate",
                "kv_events": self._describe_events(state.key, events.get(state.key)),
                "metrics": {
                    "stale": metrics.stale, "kv_cache_usage": metrics.kv_cache_usage, "running": metrics.running,
                    "waiting": metrics.waiting, "block_size": metrics.block_size,
                    "num_gpu_blocks": metrics.num_gpu_blocks,
                    "age_s": None if metrics.scraped_at is None else round(snapshot.now - metrics.scraped_at, 3),
                },
            })
        seen = self.fleet.seen_share()
        return {"draining": self.draining, "ready": self.ready()[0], "policy": self.policy.name,
                "traffic_seen": {"share": None if seen is None else round(seen, 3),
                                 "partial_view": snapshot.partial_view},
                "precise_index": None if self.precise is None else {
                    "blocks": self.precise.total_blocks, "bytes": self.precise.approx_bytes,
                    "dropped_blocks": self.precise.dropped_blocks},
                "discovery": dataclasses.asdict(self.discovery.status), "endpoints": endpoints,
                "peers": None if self.peers is None else {"origin": self.peers.origin,
                                                          "subscribed": self.peers.subscribed},
                "queue": self.admission.describe()}
