"""The gateway's one typed configuration object, built from defaults < YAML file < KVGATE_* env < CLI flags."""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from kvgate.endpoints.discovery import parse_endpoint_urls
from kvgate.policies.config import RoutingConfig
from kvgate.policies.capacity import SaturationThresholds
from kvgate.policies.priorities import PriorityConfig
from kvgate.router.admission import AdmissionConfig

ENV_PREFIX = "KVGATE_"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the setting."""


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `kvgate serve` can be told; see docs/configuration.md for each field."""

    listen: str = "0.0.0.0:8080"
    admin_listen: str | None = None  # serve /metrics and /debug/* here instead of on `listen`
    picker_listen: str | None = None  # serve Envoy's ext_proc endpoint picker (gRPC) here too
    picker_fallbacks: int = 0  # endpoints after the chosen one in x-gateway-destination-endpoint
    discovery: str = "static"  # static | kubernetes | inferencepool
    endpoints: tuple[str, ...] = ()
    namespace: str = "default"
    service: tuple[str, ...] = ()
    pool: str | None = None  # InferencePool name for discovery inferencepool
    port_name: str | None = None
    port: int | None = None
    policy: str = "cache-aware"
    connect_timeout: float = 5.0
    idle_timeout: float = 600.0  # longest silence between two upstream chunks
    request_timeout: float = 0.0  # total time for a request; 0 disables (streams can be long)
    max_body_bytes: int = 32 * 1024 * 1024
    retries: int = 1  # extra attempts on another replica after a connect failure
    drain_delay: float = 5.0
    drain_timeout: float = 120.0
    scrape_interval: float = 0.2
    scrape_timeout: float = 1.0  # a busy vLLM engine renders its /metrics page in up to ~0.8 s
    models_refresh: float = 30.0
    watch_read_timeout: float = 90.0  # the API server bookmarks about once a minute
    log_level: str = "info"
    api_keys_file: str | None = None  # YAML of API keys; off when unset (see docs/security.md)
    upstream_priority: bool = False  # set vLLM's `priority` from the class (replicas run --scheduling-policy priority)
    max_connections: int = 10000  # open client connections per listener; past it a new one gets a 503
    header_timeout: float = 30.0  # seconds a client has to send a request head, from connecting or its first byte
    body_timeout: float = 30.0  # longest silence while a request body arrives; then 408
    keepalive_timeout: float = 3630.0  # idle client connections close; above Envoy's 1 h upstream idle timeout
    kv_events_endpoint: tuple[str, ...] = ()  # tcp://{host}:5557, or REPLICA_URL=ADDRESS pairs; off when empty
    kv_events_replay_endpoint: tuple[str, ...] = ()  # the same forms, for the engines' replay sockets
    kv_events_topic: str = "kv-events"
    kv_events_bind: bool = False  # kvgate binds the (explicit) addresses and the engines connect to them
    kv_events_replay_timeout: float = 2.0  # longest wait for one replayed batch
    kv_events_hold: float = 30.0  # seconds a routed prompt's blocks count as held until the engine reports storing them
    kv_events_max_blocks: int = 1_000_000  # precise index bound, all replicas together (~260 B each: ~260 MB)
    peer_listen: str | None = None  # HOST:PORT publishing this gateway's routing decisions to the other gateways
    peers: tuple[str, ...] = ()  # HOST:PORT of the other gateways' peer_listen: learn their decisions
    peer_service: str | None = None  # headless Service (in `namespace`) over the gateway pods, port named "peers"
    tokenizer: tuple[str, ...] = ()  # MODEL=DIR: tokenize that model's requests as vLLM does (precise routing)
    tokenize_offload_bytes: int = 16384  # prompts larger than this are tokenized on a worker thread
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    priorities: PriorityConfig = field(default_factory=PriorityConfig)
    saturation: SaturationThresholds = field(default_factory=SaturationThresholds)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    @property
    def listen_address(self) -> tuple[str, int]:
        """`listen` split into host and port."""
        return split_host_port(self.listen, "listen")

    @property
    def admin_address(self) -> tuple[str, int] | None:
        """`admin_listen` split into host and port, if set."""
        return split_host_port(self.admin_listen, "admin_listen") if self.admin_listen else None

    @property
    def picker_address(self) -> tuple[str, int] | None:
        """`picker_listen` split into host and port, if set."""
        return split_host_port(self.picker_listen, "picker_listen") if self.picker_listen else None

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """`peer_listen` split into host and port, if set."""
        return split_host_port(self.peer_listen, "peer_listen") if self.peer_listen else None

    @property
    def peer_addresses(self) -> list[tuple[str, int]]:
        """`peers`, each split into host and port."""
        return [split_host_port(peer, "peers") for peer in self.peers]

    @property
    def shares_decisions(self) -> bool:
        """Whether this gateway publishes its decisions to peer gateways or learns theirs."""
        return bool(self.peer_listen or self.peers or self.peer_service)


def split_host_port(value: str, name: str) -> tuple[str, int]:
    """Parse HOST:PORT (IPv6 hosts in brackets); raises ConfigError naming the setting."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name}: expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


_FIELD_TYPES = get_type_hints(GatewayConfig)
_SECTIONS = {"routing": RoutingConfig, "priorities": PriorityConfig, "saturation": SaturationThresholds,
             "admission": AdmissionConfig}


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (kind, False)."""
    if get_origin(kind) in (Union, types.UnionType):
        args = [a for a in get_args(kind) if a is not type(None)]
        return args[0], True
    return kind, False


def _coerce(name: str, value: Any, kind: Any) -> Any:
    """Convert a raw value (str from env/CLI, or a YAML scalar/list) to the annotated type of `name`."""
    kind, optional = _unwrap_optional(kind)
    if value is None or (optional and value == ""):
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required")
    origin = get_origin(kind) or kind
    try:
        if origin is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(text for text in (str(item).strip() for item in items) if text)
        if origin in (dict, Mapping, collections.abc.Mapping):
            if isinstance(value, str):
                value = dict(item.split("=", 1) for item in value.split(",") if item.strip())
            value_type = get_args(kind)[1] if get_args(kind) else str
            return {str(k).strip(): value_type(v) for k, v in dict(value).items()}
        if origin is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(text)
            return text in ("1", "true", "yes", "on")
        if origin in (int, float):
            if isinstance(value, bool):
                raise ValueError(value)
            return origin(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot read {value!r} as {getattr(origin, '__name__', origin)}") from exc


def _build_section(section: str, raw: Mapping[str, Any]) -> Any:
    """Build one nested settings object (routing, priorities, saturation, admission) from its raw values."""
    kind = _SECTIONS[section]
    types_ = get_type_hints(kind)
    unknown = set(raw) - set(types_)
    if unknown:
        raise ConfigError(f"{section}: unknown setting(s) {', '.join(sorted(unknown))}")
    values = {k: _coerce(f"{section}.{k}", v, types_[k]) for k, v in raw.items()}
    defaults = kind()
    for name, value in values.items():
        if isinstance(value, dict):  # a partial mapping extends the default one
            values[name] = {**getattr(defaults, name), **value}
    return kind(**values)


def read_yaml(path: str) -> dict[str, Any]:
    """Load a YAML config file into a mapping; raises ConfigError for unreadable or non-mapping files."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def env_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings given as KVGATE_<NAME> environment variables (KVGATE_<SECTION>_<NAME> for nested ones)."""
    found: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        section = next((s for s in _SECTIONS if name.startswith(s + "_")), None)
        if section is not None:
            found.setdefault(section, {})[name[len(section) + 1:]] = value
        elif name in _FIELD_TYPES and name not in _SECTIONS:
            found[name] = value
    return found


def build_config(*layers: Mapping[str, Any]) -> GatewayConfig:
    """Merge setting layers (later wins; None values are skipped), coerce types and validate."""
    merged: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for layer in layers:
        for name, value in layer.items():
            if value is None:
                continue
            if name in _SECTIONS:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{name}: must be a mapping of settings")
                sections[name].update(value)
            elif name not in _FIELD_TYPES:
                raise ConfigError(f"unknown setting {name!r}")
            else:
                merged[name] = value
    values = {name: _coerce(name, value, _FIELD_TYPES[name]) for name, value in merged.items()}
    values.update({name: _build_section(name, raw) for name, raw in sections.items()})
    config = GatewayConfig(**values)
    validate(config)
    return config


def validate(config: GatewayConfig) -> None:
    """Check every value's range and the combinations; raise ConfigError with a clear message."""
    from kvgate.policies import POLICY_NAMES  # late import: the registry imports every policy

    config.listen_address
    config.admin_address
    config.picker_address
    config.peer_address
    config.peer_addresses
    if config.discovery not in ("static", "kubernetes", "inferencepool"):
        raise ConfigError(f"discovery: expected 'static', 'kubernetes' or 'inferencepool', got {config.discovery!r}")
    if config.discovery == "static" and not config.endpoints:
        raise ConfigError("endpoints: static discovery needs at least one URL (--endpoints http://host:port,...)")
    try:
        parse_endpoint_urls(config.endpoints)
    except ValueError as exc:
        raise ConfigError(f"endpoints: {exc}") from None
    if config.discovery == "kubernetes" and not config.service:
        raise ConfigError("service: kubernetes discovery needs --service NAME")
    if config.discovery == "inferencepool" and not config.pool:
        raise ConfigError("pool: inferencepool discovery needs --pool NAME")
    if config.port_name and config.port:
        raise ConfigError("port_name and port: give one, not both")
    if config.port is not None and not 0 < config.port < 65536:
        raise ConfigError(f"port: {config.port} is not a TCP port")
    if config.policy not in POLICY_NAMES:
        raise ConfigError(f"policy: {config.policy!r} is not one of {', '.join(POLICY_NAMES)}")
    positive = ("connect_timeout", "idle_timeout", "scrape_interval", "scrape_timeout", "models_refresh",
                "watch_read_timeout", "max_body_bytes", "max_connections", "header_timeout", "body_timeout",
                "keepalive_timeout")
    for name in positive:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name}: must be greater than 0, got {getattr(config, name)}")
    for name in ("request_timeout", "drain_delay", "drain_timeout", "retries", "picker_fallbacks"):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name}: must not be negative, got {getattr(config, name)}")
    _validate_kv_events(config)
    if config.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log_level: expected debug, info, warning or error, got {config.log_level!r}")
    routing = config.routing
    for name in ("block_chars", "max_blocks", "affinity_blocks", "index_default_blocks", "index_max_total_blocks"):
        if getattr(routing, name) < 1:
            raise ConfigError(f"routing.{name}: must be at least 1, got {getattr(routing, name)}")
    if routing.load_bound < 1.0:
        raise ConfigError(f"routing.load_bound: must be at least 1.0, got {routing.load_bound}")
    if routing.load_slack < 0:
        raise ConfigError(f"routing.load_slack: must not be negative, got {routing.load_slack}")
    if routing.hot_spot_bound < routing.load_bound:
        raise ConfigError(f"routing.hot_spot_bound: must be at least load_bound ({routing.load_bound}), "
                          f"got {routing.hot_spot_bound}")
    for name in ("prefill_tokens_per_second", "chars_per_token"):
        if getattr(routing, name) <= 0:
            raise ConfigError(f"routing.{name}: must be greater than 0, got {getattr(routing, name)}")
    if routing.queue_seconds_per_request < 0:
        raise ConfigError(f"routing.queue_seconds_per_request: must not be negative, got {routing.queue_seconds_per_request}")
    _validate_priorities(config)


def tokenizer_dirs(config: GatewayConfig) -> dict[str, str]:
    """`tokenizer` as model -> directory."""
    return dict(item.split("=", 1) for item in config.tokenizer)


def _validate_kv_events(config: GatewayConfig) -> None:
    """Check the KV events addresses and the tokenizer settings (the directories are read when the gateway starts)."""
    from kvgate.endpoints.kv_events import KvEventAddresses, KvEventsAddressError

    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        try:
            KvEventAddresses.parse(getattr(config, name), name)
        except KvEventsAddressError as exc:
            raise ConfigError(str(exc)) from None
    for item in config.tokenizer:
        model, sep, directory = item.partition("=")
        if not sep or not model or not directory:
            raise ConfigError(f"tokenizer: expected MODEL=DIR, got {item!r}")
    if config.kv_events_bind and any("=" not in item for item in config.kv_events_endpoint):
        raise ConfigError("kv_events_bind: needs explicit REPLICA_URL=ADDRESS pairs, not a template")
    if config.kv_events_endpoint and not config.tokenizer:
        raise ConfigError("kv_events_endpoint: precise routing needs --tokenizer MODEL=DIR for the served model(s)")
    for name in ("kv_events_replay_timeout", "kv_events_max_blocks", "tokenize_offload_bytes"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name}: must be greater than 0, got {getattr(config, name)}")
    if config.kv_events_hold < 0:
        raise ConfigError(f"kv_events_hold: must not be negative, got {config.kv_events_hold}")


def _validate_priorities(config: GatewayConfig) -> None:
    """Check the priority classes, saturation thresholds and admission bounds."""
    classes = config.priorities.classes
    if not classes or len(set(classes)) != len(classes) or any(c != c.lower() for c in classes):
        raise ConfigError(f"priorities.classes: need distinct lower-case names, got {classes!r}")
    if config.priorities.default not in classes:
        raise ConfigError(f"priorities.default: {config.priorities.default!r} is not one of {', '.join(classes)}")
    for objective, name in config.priorities.objectives.items():
        if name not in classes:
            raise ConfigError(f"priorities.objectives: {objective!r} maps to unknown class {name!r}")
    unknown_bands = [name for name in config.priorities.bands if name not in classes]
    if unknown_bands:
        raise ConfigError(f"priorities.bands: names unknown class(es) {', '.join(map(repr, unknown_bands))}")
    saturation = config.saturation
    if min(saturation.queue, saturation.in_flight, saturation.seats, saturation.seated_queue) < 0 \
            or not 0 < saturation.kv_cache <= 1:
        raise ConfigError("saturation: queue, in_flight, seats and seated_queue must be >= 0 and kv_cache in (0, 1]")
    admission = config.admission
    for name, bound in (*admission.class_max_requests.items(), *admission.max_wait.items()):
        if name not in classes:
            raise ConfigError(f"admission: per-class setting names unknown class {name!r}")
        if bound <= 0:
            raise ConfigError(f"admission: the bound for class {name!r} must be greater than 0")
    if admission.max_requests < 1 or admission.max_bytes < 1 or admission.retry_after_s < 1:
        raise ConfigError("admission: max_requests, max_bytes and retry_after_s must be at least 1")
    if not 0 <= admission.min_share < 1:
        raise ConfigError(f"admission.min_share: must be in [0, 1), got {admission.min_share}")
    for name, share in admission.reserve.items():
        if name not in classes:
            raise ConfigError(f"admission.reserve: names unknown class {name!r}")
        if not 0 <= share < 1:
            raise ConfigError(f"admission.reserve: the share for class {name!r} must be in [0, 1), got {share}")
    unknown = [name for name in admission.preemptible if name not in classes]
    if unknown:
        raise ConfigError(f"admission.preemptible: names unknown class(es) {', '.join(map(repr, unknown))}")
    if admission.max_preemptions < 0:
        raise ConfigError(f"admission.max_preemptions: must not be negative, got {admission.max_preemptions}")
    if admission.lookahead < 0:
        raise ConfigError(f"admission.lookahead: must not be negative, got {admission.lookahead}")
    if admission.reserve_idle_s < 0:
        raise ConfigError(f"admission.reserve_idle_s: must not be negative, got {admission.reserve_idle_s}")


def config_fields() -> list[dataclasses.Field]:
    """The top-level settings, for building CLI flags."""
    return [f for f in dataclasses.fields(GatewayConfig) if f.name not in _SECTIONS]


def section_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section, field) for every nested setting, for building CLI flags."""
    return [(name, f) for name, kind in _SECTIONS.items() for f in dataclasses.fields(kind)]


def from_sources(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Build the configuration from a YAML file named by --config / KVGATE_CONFIG, the env and CLI values."""
    environ = os.environ if environ is None else environ
    cli = dict(cli)
    path = cli.pop("config", None) or environ.get(f"{ENV_PREFIX}CONFIG")
    file_layer = read_yaml(path) if path else {}
    return build_config(file_layer, env_settings(environ), cli)
