"""Builds routing policies by name."""

from __future__ import annotations

from collections.abc import Callable

from kvgate.policies.cache_aware import CacheAwarePolicy
from kvgate.policies.config import RoutingConfig
from kvgate.policies.least_load import LeastLoadPolicy
from kvgate.policies.precise_index import PrecisePrefixIndex
from kvgate.policies.prefix_hash import PrefixHashPolicy
from kvgate.policies.round_robin import RoundRobinPolicy
from kvgate.policies.types import Policy

_BUILDERS: dict[str, Callable[[RoutingConfig], Policy]] = {
    CacheAwarePolicy.name: CacheAwarePolicy,
    PrefixHashPolicy.name: PrefixHashPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(_BUILDERS)
DEFAULT_POLICY = CacheAwarePolicy.name


def build_policy(name: str, config: RoutingConfig, precise: PrecisePrefixIndex | None = None) -> Policy:
    """A new policy instance (cache-aware consults `precise` where it is known); ValueError for an unknown name."""
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(POLICY_NAMES)}") from None
    if builder is CacheAwarePolicy:
        return CacheAwarePolicy(config, precise)
    return builder(config)
