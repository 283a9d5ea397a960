"""InferencePool, Pod and InferenceObjective objects (JSON as the API server sends them), read into plain values.

Pure functions: what a pool selects and offers, whether a pod may take requests, an objective's priority.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.endpoints.k8s_watch import ObjectError, object_name
from kvgate.endpoints.types import Endpoint

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
OBJECTIVE_GROUP, OBJECTIVE_VERSION = "inference.networking.x-k8s.io", "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What an InferencePool selects (its pods' labels) and offers (their target ports)."""

    match_labels: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        """The pods' label selector as the API takes it, e.g. `app=vllm,tier=gpu`."""
        return ",".join(f"{key}={value}" for key, value in self.match_labels)


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod of a pool: its name, IP, and whether it may take new requests."""

    namespace: str
    name: str
    ip: str
    accepting: bool


def read_pool(obj: Mapping[str, Any]) -> PoolSpec:
    """The spec of an InferencePool; ObjectError when its selector or ports are unusable."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise ObjectError("inferencepool has no spec")
    selector = spec.get("selector")
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ObjectError("inferencepool spec.selector.matchLabels is missing or malformed")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        raise ObjectError("inferencepool spec.targetPorts must list 1 to 8 ports")
    numbers = tuple(p.get("number") if isinstance(p, dict) else None for p in ports)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536 for n in numbers) \
            or len(set(numbers)) != len(numbers):
        raise ObjectError(f"inferencepool spec.targetPorts are not distinct TCP ports: {ports!r}")
    return PoolSpec(match_labels=tuple(sorted(labels.items())), target_ports=numbers)


def read_pod(obj: Mapping[str, Any]) -> Pod | None:
    """A pod with an IP, accepting while Ready and not being deleted; None while it has no IP yet."""
    name = object_name(obj)
    meta = obj["metadata"]
    status = obj.get("status")
    if not isinstance(status, dict) or not status.get("podIP"):
        return None
    try:
        ip = ipaddress.ip_address(status["podIP"])
    except ValueError:
        raise ObjectError(f"pod {name} has a bad podIP {status['podIP']!r}") from None
    conditions = status.get("conditions")
    ready = isinstance(conditions, list) and any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    deleting = meta.get("deletionTimestamp") is not None
    return Pod(namespace=meta.get("namespace") or "", name=name,
               ip=f"[{ip}]" if ip.version == 6 else str(ip), accepting=ready and not deleting)


def pool_endpoints(pool: str, spec: PoolSpec, pods: Iterable[Pod | None]) -> list[Endpoint]:
    """`podIP:targetPort` for every pod with an IP and every target port, sorted by key.

    The key is `namespace/pod`, with `:port` added when the pool has more than one target port.
    """
    found = []
    for pod in pods:
        if pod is None:
            continue
        for port in spec.target_ports:
            key = f"{pod.namespace}/{pod.name}" + (f":{port}" if len(spec.target_ports) > 1 else "")
            found.append(Endpoint(key=key, url=f"http://{pod.ip}:{port}", accepting=pod.accepting, pool=pool))
    return sorted(found, key=lambda e: e.key)


def read_objective(obj: Mapping[str, Any]) -> tuple[str, int]:
    """An InferenceObjective's (pool name, priority); an unset priority is 0."""
    spec = obj.get("spec")
    pool_ref = spec.get("poolRef") if isinstance(spec, dict) else None
    pool = pool_ref.get("name") if isinstance(pool_ref, dict) else None
    if not isinstance(pool, str) or not pool:
        raise ObjectError("inferenceobjective has no spec.poolRef.name")
    priority = spec.get("priority", 0)
    if priority is None:
        priority = 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ObjectError(f"inferenceobjective spec.priority is not an integer: {priority!r}")
    return pool, priority
