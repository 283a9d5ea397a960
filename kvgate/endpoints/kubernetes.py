"""Kubernetes discovery: a Service's EndpointSlices, listed then watched, as kvgate Endpoints.

Uses the raw list/watch responses of `kubernetes.aio` rather than its `Watch` helper: that helper
deserializes every object into models (one malformed object would break the stream), silently
reconnects from a stale resourceVersion when no timeout is given, and offers no read timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
from kubernetes.aio import client as k8s_client
from kubernetes.aio import config as k8s_config

from kvgate.endpoints.discovery import DiscoveryStatus, EndpointsCallback
from kvgate.endpoints.k8s_slices import SERVICE_NAME_LABEL, SliceError, SliceReader, merge_endpoints, slice_name
from kvgate.endpoints.model import Endpoint

log = logging.getLogger(__name__)


async def load_kubernetes_config(kubeconfig: str | None = None) -> None:
    """Set the client's default configuration: `kubeconfig`, else in-cluster, else $KUBECONFIG or ~/.kube/config."""
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config()
            return
        except k8s_config.ConfigException:
            # KUBECONFIG is read now: the client library reads it once, at import time
            kubeconfig = os.environ.get("KUBECONFIG")
    await k8s_config.load_kube_config(config_file=kubeconfig)


class _Expired(Exception):
    """The watch's resourceVersion is older than the server's history (410): list again."""


class _Broken(Exception):
    """The API server answered, but not with a usable list or watch stream."""


class EndpointSliceWatcher:
    """Discovery from one Service's EndpointSlices: list, watch, and list again after any break.

    The port is the slice port named `port_name`, else `port` as given, else the slice's only port.
    """

    def __init__(
        self,
        namespace: str,
        service: str,
        port_name: str | None = None,
        port: int | None = None,
        scheme: str = "http",
        pool: str | None = None,
        read_timeout_s: float = 90.0,  # kube-apiserver sends a bookmark about once a minute
        watch_timeout_s: int = 300,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 10.0,
        api_client_factory: Callable[[], k8s_client.ApiClient] = k8s_client.ApiClient,
    ) -> None:
        self.status = DiscoveryStatus()
        self.namespace = namespace
        self.service = service
        self._reader = SliceReader(pool=pool or service, port_name=port_name, port=port, scheme=scheme)
        self._selector = f"{SERVICE_NAME_LABEL}={service}"
        self._read_timeout_s = read_timeout_s
        self._watch_timeout_s = int(watch_timeout_s)  # the client insists on an int timeoutSeconds
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._api_client_factory = api_client_factory
        self._slices: dict[str, tuple[Endpoint, ...]] = {}
        self._resource_version: str | None = None  # None: the next step is a (re)list
        self._reported: list[Endpoint] | None = None
        self._failures = 0  # attempts since a watch last delivered an event; sets the backoff

    async def run(self, on_change: EndpointsCallback) -> None:
        """List and watch until cancelled, calling `on_change` with every endpoint whenever the set changes."""
        async with self._api_client_factory() as api_client:
            api = k8s_client.DiscoveryV1Api(api_client)
            while True:
                reason = await self._list_and_watch(api, on_change)
                self.status.restarts += 1
                if reason is None:  # the server ended a working stream: follow on at once from its resourceVersion
                    continue
                self._failures += 1
                delay = self._backoff()
                log.warning("endpointslice watch restarting service=%s reason=%s retry_in=%.2fs",
                            self.service, reason, delay)
                await asyncio.sleep(delay)

    async def _list_and_watch(self, api: k8s_client.DiscoveryV1Api, on_change: EndpointsCallback) -> str | None:
        """List if needed, then follow one watch; None if it ended cleanly after events, else why it ended."""
        try:
            if self._resource_version is None:
                await self._list(api, on_change)
            return None if await self._watch(api, on_change) else "watch closed without events"
        except _Expired as exc:
            self._resource_version = None
            return f"expired ({exc})"
        except (_Broken, aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
            self._resource_version = None
            self.status.healthy = False
            if isinstance(exc, TimeoutError):
                self.status.detail = f"no answer for {self._read_timeout_s:g}s"
            else:
                self.status.detail = str(exc) or type(exc).__name__
            return self.status.detail

    async def _list(self, api: k8s_client.DiscoveryV1Api, on_change: EndpointsCallback) -> None:
        """Replace the whole state with a fresh list, so deletions missed while not watching disappear."""
        async with asyncio.timeout(self._read_timeout_s):
            response = await api.list_namespaced_endpoint_slice_without_preload_content(
                self.namespace, label_selector=self._selector, _request_timeout=float(self._read_timeout_s))
            try:
                _check_status(response)
                body = orjson.loads(await response.read())
            finally:
                response.close()
        if not isinstance(body, dict) or not isinstance(body.get("items"), list):
            raise _Broken("list response has no items")
        slices = {}
        for obj in body["items"]:
            try:
                slices[slice_name(obj)] = self._reader.read(obj)
            except SliceError as exc:
                log.warning("endpointslice skipped service=%s reason=%s", self.service, exc)
        if self.status.synced:
            self.status.relists += 1
        self._slices = slices
        self._resource_version = _resource_version_of(body) or ""
        self.status.synced = True
        self.status.healthy = True
        self.status.detail = ""
        self.status.last_event_at = time.monotonic()
        log.info("endpointslices listed service=%s slices=%d rv=%s",
                 self.service, len(slices), self._resource_version)
        self._report(on_change)

    async def _watch(self, api: k8s_client.DiscoveryV1Api, on_change: EndpointsCallback) -> bool:
        """Follow one watch stream until the server ends it; whether it delivered any event."""
        async with asyncio.timeout(self._read_timeout_s):
            response = await api.list_namespaced_endpoint_slice_without_preload_content(
                self.namespace, label_selector=self._selector, watch=True,
                resource_version=self._resource_version or None, allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                _request_timeout=float(self._watch_timeout_s + self._read_timeout_s))
        delivered = False
        try:
            _check_status(response)
            self.status.healthy = True
            self.status.detail = ""
            async for event in self._events(response):
                self._apply(event)
                delivered = True
                self._failures = 0
                self.status.last_event_at = time.monotonic()
                self._report(on_change)
        finally:
            response.close()
        return delivered

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The stream's newline-delimited JSON events; TimeoutError when it is silent too long."""
        buffer = bytearray()
        while True:
            async with asyncio.timeout(self._read_timeout_s):
                chunk = await response.content.readany()
            if not chunk:
                if buffer.strip():
                    raise _Broken("watch stream ended mid-event")
                return
            buffer += chunk
            if b"\n" not in chunk:
                continue
            *lines, rest = buffer.split(b"\n")
            buffer = bytearray(rest)
            for line in lines:
                if line.strip():
                    yield orjson.loads(line)

    def _apply(self, event: Any) -> None:
        """Fold one watch event into the state and the resourceVersion."""
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if not isinstance(obj, dict):
            log.warning("watch event skipped service=%s reason=no object", self.service)
            return
        if kind == "ERROR":
            message = f"code={obj.get('code')} reason={obj.get('reason')} message={obj.get('message')}"
            raise _Expired(message) if obj.get("code") == 410 else _Broken(f"error event {message}")
        version = _resource_version_of(obj)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            try:
                name = slice_name(obj)
            except SliceError as exc:
                log.warning("watch event skipped service=%s type=%s reason=%s", self.service, kind, exc)
            else:
                if kind == "DELETED":
                    self._slices.pop(name, None)
                else:
                    self._slices[name] = self._reader.read(obj)
        elif kind != "BOOKMARK":
            log.warning("watch event skipped service=%s type=%s reason=unknown type", self.service, kind)
        if version:
            self._resource_version = version

    def _report(self, on_change: EndpointsCallback) -> None:
        """Call `on_change` with the merged endpoint list, only when it differs from the last report."""
        endpoints = merge_endpoints(self._slices.values())
        if endpoints != self._reported:
            self._reported = endpoints
            on_change(list(endpoints))

    def _backoff(self) -> float:
        """Exponential delay with jitter, so many gateway replicas do not reconnect in step."""
        ceiling = min(self._backoff_max_s, self._backoff_base_s * 2 ** min(self._failures - 1, 30))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


def _check_status(response: aiohttp.ClientResponse) -> None:
    if response.status == 410:
        raise _Expired("http 410")
    if response.status != 200:
        raise _Broken(f"http {response.status} {response.reason}")


def _resource_version_of(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version else None
