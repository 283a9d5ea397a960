"""A small Kubernetes API server for tests: list and watch, spoken like kube-apiserver.

It serves EndpointSlices, Pods, InferencePools and InferenceObjectives (RESOURCES) with equality label
selectors, a `metadata.name` field selector, resourceVersion bookkeeping, BOOKMARK events, 410 Expired
for compacted history and server-side watch timeouts; tests can also hang open watches, end them, or take
the whole server down.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

SERVICE_LABEL = "kubernetes.io/service-name"
GROUP_VERSION = "discovery.k8s.io/v1"
POOL_GROUP_VERSION = "inference.networking.k8s.io/v1"
OBJECTIVE_GROUP_VERSION = "inference.networking.x-k8s.io/v1alpha2"
# kind -> (plural, apiVersion, URL prefix before /namespaces/{ns}/{plural})
RESOURCES = {
    "EndpointSlice": ("endpointslices", GROUP_VERSION, "/apis/" + GROUP_VERSION),
    "Pod": ("pods", "v1", "/api/v1"),
    "InferencePool": ("inferencepools", POOL_GROUP_VERSION, "/apis/" + POOL_GROUP_VERSION),
    "InferenceObjective": ("inferenceobjectives", OBJECTIVE_GROUP_VERSION, "/apis/" + OBJECTIVE_GROUP_VERSION),
}
TOKEN = "kvgate-test-token"

Event = dict[str, Any]
# ip, pod, ready, serving, terminating
EndpointSpec = tuple[str, str | None, bool | None, bool | None, bool | None]


def make_slice(
    service: str,
    name: str,
    endpoints: Sequence[EndpointSpec] = (),
    ports: Sequence[tuple[str, int]] = (("http", 8000),),
    namespace: str = "default",
) -> dict[str, Any]:
    """An EndpointSlice of `service`; each endpoint is (ip, pod or None, ready, serving, terminating).

    A condition given as None is left out of the object, as the controller does for unknown values.
    """
    return {
        "kind": "EndpointSlice",
        "apiVersion": GROUP_VERSION,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {SERVICE_LABEL: service,
                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
            "generateName": f"{service}-",
        },
        "addressType": "IPv6" if any(":" in ip for ip, *_ in endpoints) else "IPv4",
        "endpoints": [_make_endpoint(namespace, *spec) for spec in endpoints],
        "ports": [{"name": port_name, "port": number, "protocol": "TCP"} for port_name, number in ports],
    }


def _make_endpoint(namespace: str, ip: str, pod: str | None,
                   ready: bool | None, serving: bool | None, terminating: bool | None) -> dict[str, Any]:
    given = {"ready": ready, "serving": serving, "terminating": terminating}
    conditions = {name: value for name, value in given.items() if value is not None}
    endpoint: dict[str, Any] = {"addresses": [ip], "conditions": conditions, "nodeName": "node-a", "zone": "zone-a"}
    if pod is not None:
        endpoint["targetRef"] = {"kind": "Pod", "namespace": namespace, "name": pod, "uid": f"uid-{pod}"}
    return endpoint


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    """A meta/v1 Status as the API server sends for failures."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


@dataclass(frozen=True)
class _Filter:
    """The kind, namespace, equality label selector and name field selector of one list or watch call."""

    kind: str
    namespace: str
    labels: dict[str, str]
    name: str | None = None

    def matches(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        return (obj.get("kind") == self.kind and meta.get("namespace") == self.namespace
                and self.name in (None, meta.get("name")) and all(labels.get(k) == v for k, v in self.labels.items()))


@dataclass(eq=False)
class _Watch:
    """One open watch stream: its filter and the events waiting to be written."""

    filter: _Filter
    bookmarks: bool
    request: web.Request
    queue: asyncio.Queue[Event | None] = field(default_factory=asyncio.Queue)
    hung: bool = False

    @property
    def connected(self) -> bool:
        transport = self.request.transport
        return transport is not None and not transport.is_closing()


def parse_label_selector(text: str) -> dict[str, str]:
    """Equality terms `k=v`, `k==v`, comma-separated; anything else raises ValueError."""
    terms: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = term.replace("==", "=").partition("=")
        if not sep or not key or "!" in key:
            raise ValueError(f"unsupported label selector term {term!r}")
        terms[key.strip()] = value.strip()
    return terms


def parse_name_selector(text: str) -> str | None:
    """The name of a `metadata.name=NAME` field selector, None for none; anything else raises ValueError."""
    if not text:
        return None
    key, sep, value = text.replace("==", "=").partition("=")
    if key.strip() != "metadata.name" or not sep or "," in value:
        raise ValueError(f"unsupported field selector {text!r}")
    return value.strip()


class K8sTestApi:
    """An in-process kube-apiserver stand-in for the RESOURCES, on a real 127.0.0.1 socket."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.port = 0
        self.list_requests = 0
        self.watch_requests: list[dict[str, str]] = []  # query of every watch call, oldest first
        self._rv = 100
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name)
        self._history: list[tuple[int, Event]] = []
        self._compacted_rv = 0  # a watch from an RV below this gets 410 Expired
        self._watches: set[_Watch] = set()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. http://127.0.0.1:40123."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def resource_version(self) -> str:
        """The newest resourceVersion the server has handed out."""
        return str(self._rv)

    @property
    def open_watches(self) -> int:
        """How many watch streams are connected and not hung."""
        return sum(not w.hung and w.connected for w in self._watches)

    async def start(self) -> None:
        """Listen on 127.0.0.1, on the previous port after a stop, else on a free one."""
        app = web.Application()
        for kind, (plural, _, prefix) in RESOURCES.items():
            app.router.add_get(f"{prefix}/namespaces/{{namespace}}/{plural}", functools.partial(self._serve, kind))
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        """Go down: drop every stream mid-response and stop listening (connections are refused until start())."""
        for watch in self._watches:
            if watch.connected:
                watch.request.transport.close()
            watch.hung = False
            watch.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self) -> None:
        """Stop and start again on the same port, keeping the stored objects and history."""
        await self.stop()
        await self.start()

    def apply_slice(self, obj: dict[str, Any]) -> str:
        """Create or replace a slice (ADDED or MODIFIED to watchers); returns its new resourceVersion."""
        return self.apply(obj)

    def delete_slice(self, name: str, namespace: str = "default") -> str:
        """Delete a slice (DELETED carries its last state at the deletion's resourceVersion)."""
        return self.delete("EndpointSlice", name, namespace)

    def apply(self, obj: dict[str, Any]) -> str:
        """Create or replace an object of one of the RESOURCES kinds; returns its new resourceVersion."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (obj["kind"], meta["namespace"], meta["name"])
        kind = "MODIFIED" if key in self._objects else "ADDED"
        meta["resourceVersion"] = self._next_rv()
        meta.setdefault("uid", f"uid-{meta['name']}")
        self._objects[key] = obj
        self._publish(kind, obj)
        return meta["resourceVersion"]

    def delete(self, kind: str, name: str, namespace: str = "default") -> str:
        """Delete an object (DELETED carries its last state at the deletion's resourceVersion)."""
        obj = self._objects.pop((kind, namespace, name))
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._publish("DELETED", obj)
        return obj["metadata"]["resourceVersion"]

    def compact(self) -> None:
        """Forget history: a watch from any resourceVersion older than the newest gets 410 Expired."""
        self._history.clear()
        self._compacted_rv = self._rv

    def bookmark(self) -> None:
        """Send a BOOKMARK at the newest resourceVersion to every watch that asked for bookmarks."""
        for watch in self._watches:
            if watch.bookmarks:
                watch.queue.put_nowait(self._bookmark_event(watch.filter.kind))

    def inject(self, event: Event) -> None:
        """Send `event` as is to every open watch (not recorded in history), e.g. a malformed one."""
        for watch in self._watches:
            watch.queue.put_nowait(event)

    def end_watches(self) -> None:
        """Close every open, not hung watch cleanly, as the server does when a watch's timeout runs out."""
        for watch in self._watches:
            if not watch.hung:
                watch.queue.put_nowait(None)

    def hang_watches(self) -> None:
        """Open watches go silent without closing, like a stream behind a network partition."""
        for watch in self._watches:
            watch.hung = True

    def write_kubeconfig(self, path: str | Path) -> Path:
        """Write a kubeconfig (plain-http server, bearer token) the `kubernetes` client loads."""
        path = Path(path)
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": self.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "default"}}],
            "current-context": "test",
        }))
        return path

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _publish(self, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self._history.append((self._rv, event))
        for watch in self._watches:
            if watch.filter.matches(obj):
                watch.queue.put_nowait(event)

    def _bookmark_event(self, kind: str) -> Event:
        # kube-apiserver sends an otherwise empty object of the watched kind
        return {"type": "BOOKMARK", "object": {
            "kind": kind, "apiVersion": RESOURCES[kind][1],
            "metadata": {"resourceVersion": self.resource_version, "creationTimestamp": None},
        }}

    async def _serve(self, kind: str, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status_object(401, "Unauthorized", "Unauthorized"), status=401)
        try:
            selector = parse_label_selector(request.query.get("labelSelector", ""))
            name = parse_name_selector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return web.json_response(status_object(400, "BadRequest", str(exc)), status=400)
        selected = _Filter(kind, request.match_info["namespace"], selector, name)
        if request.query.get("watch") in ("1", "true"):
            bookmarks = request.query.get("allowWatchBookmarks") == "true"
            return await self._serve_watch(request, _Watch(selected, bookmarks, request))
        self.list_requests += 1
        items = []
        for obj in self._objects.values():
            if selected.matches(obj):
                item = copy.deepcopy(obj)
                del item["kind"], item["apiVersion"]  # list items carry no kind/apiVersion
                items.append(item)
        return web.json_response({"kind": f"{kind}List", "apiVersion": RESOURCES[kind][1],
                                  "metadata": {"resourceVersion": self.resource_version}, "items": items})

    async def _serve_watch(self, request: web.Request, watch: _Watch) -> web.StreamResponse:
        self.watch_requests.append(dict(request.query))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        since = int(request.query.get("resourceVersion") or 0)
        if since and since < self._compacted_rv:
            message = f"too old resource version: {since} ({self._compacted_rv})"
            await self._write(response, {"type": "ERROR", "object": status_object(410, "Expired", message)})
            return response
        if since:
            backlog = [event for rv, event in self._history if rv > since]
        else:  # no resourceVersion: the current state as synthetic ADDED events, then changes
            backlog = [{"type": "ADDED", "object": copy.deepcopy(obj)} for obj in self._objects.values()]
        for event in backlog:
            if watch.filter.matches(event["object"]):
                watch.queue.put_nowait(event)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        self._watches.add(watch)
        try:
            await self._stream(response, watch, asyncio.get_running_loop().time() + timeout)
        except ConnectionResetError:
            pass  # the client went away, as watch clients do when they time out
        finally:
            self._watches.discard(watch)
        return response

    async def _stream(self, response: web.StreamResponse, watch: _Watch, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # a partitioned stream never times out
            remaining = None if watch.hung else max(0.0, deadline - loop.time())
            try:
                event = await asyncio.wait_for(watch.queue.get(), remaining)
            except TimeoutError:
                if watch.bookmarks:  # like kube-apiserver, a last bookmark before the deadline closes the watch
                    await self._write(response, self._bookmark_event(watch.filter.kind))
                return
            if event is None:
                return
            if watch.hung:
                continue
            await self._write(response, event)

    @staticmethod
    async def _write(response: web.StreamResponse, event: Event) -> None:
        await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")


def make_pool(name: str, match_labels: dict[str, str], ports: Sequence[int] = (8000,),
              namespace: str = "default", failure_mode: str = "FailClose") -> dict[str, Any]:
    """An InferencePool selecting pods by `match_labels`, offering `ports`, picked by kvgate's Service."""
    return {
        "kind": "InferencePool", "apiVersion": POOL_GROUP_VERSION,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"selector": {"matchLabels": dict(match_labels)},
                 "targetPorts": [{"number": port} for port in ports],
                 "endpointPickerRef": {"kind": "Service", "name": "kvgate-picker", "port": {"number": 9002},
                                       "failureMode": failure_mode}},
    }


def make_pod(name: str, ip: str | None, labels: dict[str, str], ready: bool = True, deleting: bool = False,
             namespace: str = "default") -> dict[str, Any]:
    """A Running pod with `ip` (None: not started), its Ready condition, and a deletionTimestamp when `deleting`."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running" if ip else "Pending",
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": {"containers": [{"name": "vllm"}]},
            "status": status}


def make_objective(name: str, pool: str, priority: int | None, namespace: str = "default") -> dict[str, Any]:
    """An InferenceObjective of `pool` with `priority` (None: left unset)."""
    spec: dict[str, Any] = {"poolRef": {"group": "inference.networking.k8s.io", "name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"kind": "InferenceObjective", "apiVersion": OBJECTIVE_GROUP_VERSION,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
