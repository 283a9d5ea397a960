"""EndpointSlice objects (JSON as the API server sends them) to kvgate Endpoints.

Pure functions: which port to use, what the conditions mean, how duplicates across slices merge.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.endpoints.k8s_watch import ObjectError, object_name
from kvgate.endpoints.types import Endpoint

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class SliceError(ObjectError):
    """An EndpointSlice, or one endpoint in it, cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class SliceReader:
    """Turns one EndpointSlice into Endpoints, skipping what is malformed with one log line each."""

    pool: str
    port_name: str | None = None
    port: int | None = None  # used as is when given without port_name
    scheme: str = "http"

    def read(self, obj: Mapping[str, Any]) -> tuple[Endpoint, ...]:
        """The usable endpoints of `obj`; an unusable slice yields none."""
        name = object_name(obj)
        try:
            port = self._choose_port(obj.get("ports"))
        except SliceError as exc:
            log.warning("endpointslice skipped slice=%s reason=%s", name, exc)
            return ()
        raw_endpoints = obj.get("endpoints") or []
        if not isinstance(raw_endpoints, list):
            log.warning("endpointslice skipped slice=%s reason=endpoints is not a list", name)
            return ()
        namespace = obj["metadata"].get("namespace") or ""
        found = []
        for raw in raw_endpoints:
            try:
                found.append(self._endpoint(raw, port, namespace, obj.get("addressType")))
            except SliceError as exc:
                log.warning("endpoint skipped slice=%s reason=%s", name, exc)
        return tuple(found)

    def _choose_port(self, ports: Any) -> int:
        if self.port is not None and self.port_name is None:
            return self.port
        if not isinstance(ports, list) or not all(isinstance(p, dict) for p in ports):
            raise SliceError("ports missing or malformed")
        if self.port_name is not None:
            matches = [p for p in ports if p.get("name") == self.port_name]
            if not matches:
                raise SliceError(f"no port named {self.port_name!r}")
            return _port_number(matches[0])
        if len(ports) != 1:
            raise SliceError(f"{len(ports)} ports and no port name chosen")
        return _port_number(ports[0])

    def _endpoint(self, raw: Any, port: int, namespace: str, address_type: Any) -> Endpoint:
        if not isinstance(raw, dict):
            raise SliceError("endpoint is not an object")
        addresses = raw.get("addresses")
        if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
            raise SliceError("endpoint has no address")
        host = _url_host(addresses[0], address_type)
        return Endpoint(
            key=_pod_key(raw.get("targetRef"), namespace) or addresses[0],
            url=f"{self.scheme}://{host}:{port}",
            accepting=_accepting(raw.get("conditions")),
            pool=self.pool,
        )


def merge_endpoints(slices: Iterable[tuple[Endpoint, ...]]) -> list[Endpoint]:
    """One endpoint per key, sorted by key; a pod listed twice (moving between slices) accepts if either copy does."""
    merged: dict[str, Endpoint] = {}
    for endpoints in slices:
        for endpoint in endpoints:
            seen = merged.get(endpoint.key)
            if seen is None or (endpoint.accepting and not seen.accepting):
                merged[endpoint.key] = endpoint
    return [merged[key] for key in sorted(merged)]


def _port_number(port: Mapping[str, Any]) -> int:
    number = port.get("port")
    if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
        raise SliceError(f"bad port number {number!r}")
    return number


def _url_host(address: str, address_type: Any) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if address_type == "FQDN" and address and not any(c in address for c in "/:@ "):
            return address
        raise SliceError(f"bad address {address!r}") from None
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _pod_key(target_ref: Any, namespace: str) -> str | None:
    if not isinstance(target_ref, dict) or not isinstance(target_ref.get("name"), str):
        return None
    return f"{target_ref.get('namespace') or namespace}/{target_ref['name']}"


def _accepting(conditions: Any) -> bool:
    """Whether the endpoint may take new requests.

    `ready` alone is not enough: with publishNotReadyAddresses it is always true, while `serving`
    still tracks pod readiness and `terminating` marks a draining pod (nil serving means ready).
    """
    if conditions is None:
        conditions = {}
    if not isinstance(conditions, dict):
        raise SliceError("conditions is not an object")
    ready, serving, terminating = (conditions.get(k) for k in ("ready", "serving", "terminating"))
    if any(v is not None and not isinstance(v, bool) for v in (ready, serving, terminating)):
        raise SliceError(f"malformed conditions {conditions!r}")
    ready = ready is not False
    serving = ready if serving is None else serving
    return ready and serving and not terminating
