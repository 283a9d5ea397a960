"""List + watch of one kind of Kubernetes object, kept as a name -> parsed value map.

Uses the raw list/watch responses of `kubernetes.aio` rather than its `Watch` helper: that helper
deserializes every object into models (one malformed object would break the stream), silently
reconnects from a stale resourceVersion when no timeout is given, and offers no read timeout.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp
import orjson

from kvgate.endpoints.discovery import DiscoveryStatus

log = logging.getLogger(__name__)

T = TypeVar("T")
# Calls a `..._without_preload_content` list method with the watch/list query given as keyword arguments.
ListCall = Callable[..., Awaitable[aiohttp.ClientResponse]]


class ObjectError(ValueError):
    """An object, or a part of it, cannot be used; the message says why."""


@dataclass(frozen=True)
class WatchSettings:
    """Timeouts and retry pacing shared by every watch."""

    read_timeout_s: float = 90.0  # kube-apiserver sends a bookmark about once a minute
    watch_timeout_s: int = 300
    backoff_base_s: float = 0.2
    backoff_max_s: float = 10.0


class _Expired(Exception):
    """The watch's resourceVersion is older than the server's history (410): list again."""


class _Broken(Exception):
    """The API server answered, but not with a usable list or watch stream."""


class ResourceWatch(Generic[T]):
    """Lists then watches objects of one kind, lists again after any break, and keeps each one parsed.

    `parse` turns an object into its value or raises ObjectError (the object is then skipped, with a log line
    naming `label`, and a watched object keeps its previous value). `on_change` runs after every list and
    every watch event; `items` holds the current values by object name.
    """

    def __init__(self, label: str, list_call: ListCall, parse: Callable[[dict[str, Any]], T],
                 settings: WatchSettings = WatchSettings()) -> None:
        self.status = DiscoveryStatus()
        self.items: dict[str, T] = {}
        self._label = label
        self._list_call = list_call
        self._parse = parse
        self._settings = settings
        self._resource_version: str | None = None  # None: the next step is a (re)list
        self._failures = 0  # attempts since a watch last delivered an event; sets the backoff

    async def run(self, on_change: Callable[[], None]) -> None:
        """List and watch until cancelled."""
        while True:
            reason = await self._list_and_watch(on_change)
            self.status.restarts += 1
            if reason is None:  # the server ended a working stream: follow on at once from its resourceVersion
                continue
            self._failures += 1
            delay = self._backoff()
            log.warning("watch restarting %s reason=%s retry_in=%.2fs", self._label, reason, delay)
            await asyncio.sleep(delay)

    async def _list_and_watch(self, on_change: Callable[[], None]) -> str | None:
        """List if needed, then follow one watch; None if it ended cleanly after events, else why it ended."""
        try:
            if self._resource_version is None:
                await self._list(on_change)
            return None if await self._watch(on_change) else "watch closed without events"
        except _Expired as exc:
            self._resource_version = None
            return f"expired ({exc})"
        except (_Broken, aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
            self._resource_version = None
            self.status.healthy = False
            if isinstance(exc, TimeoutError):
                self.status.detail = f"no answer for {self._settings.read_timeout_s:g}s"
            else:
                self.status.detail = str(exc) or type(exc).__name__
            return self.status.detail

    async def _list(self, on_change: Callable[[], None]) -> None:
        """Replace the whole state with a fresh list, so deletions missed while not watching disappear."""
        read_timeout = self._settings.read_timeout_s
        async with asyncio.timeout(read_timeout):
            response = await self._list_call(_request_timeout=float(read_timeout))
            try:
                _check_status(response)
                body = orjson.loads(await response.read())
            finally:
                response.close()
        if not isinstance(body, dict) or not isinstance(body.get("items"), list):
            raise _Broken("list response has no items")
        items = {}
        for obj in body["items"]:
            try:
                items[object_name(obj)] = self._parse(obj)
            except ObjectError as exc:
                log.warning("object skipped %s reason=%s", self._label, exc)
        if self.status.synced:
            self.status.relists += 1
        self.items = items
        self._resource_version = _resource_version_of(body) or ""
        self.status.synced = True
        self.status.healthy = True
        self.status.detail = ""
        self.status.last_event_at = time.monotonic()
        log.info("listed %s objects=%d rv=%s", self._label, len(items), self._resource_version)
        on_change()

    async def _watch(self, on_change: Callable[[], None]) -> bool:
        """Follow one watch stream until the server ends it; whether it delivered any event."""
        settings = self._settings
        async with asyncio.timeout(settings.read_timeout_s):
            response = await self._list_call(
                watch=True, resource_version=self._resource_version or None, allow_watch_bookmarks=True,
                timeout_seconds=int(settings.watch_timeout_s),  # the client insists on an int timeoutSeconds
                _request_timeout=float(settings.watch_timeout_s + settings.read_timeout_s))
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
                on_change()
        finally:
            response.close()
        return delivered

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The stream's newline-delimited JSON events; TimeoutError when it is silent too long."""
        buffer = bytearray()
        while True:
            async with asyncio.timeout(self._settings.read_timeout_s):
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
            log.warning("watch event skipped %s reason=no object", self._label)
            return
        if kind == "ERROR":
            message = f"code={obj.get('code')} reason={obj.get('reason')} message={obj.get('message')}"
            raise _Expired(message) if obj.get("code") == 410 else _Broken(f"error event {message}")
        version = _resource_version_of(obj)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            try:
                name = object_name(obj)
                if kind == "DELETED":
                    self.items.pop(name, None)
                else:
                    self.items[name] = self._parse(obj)
            except ObjectError as exc:
                log.warning("watch event skipped %s type=%s reason=%s", self._label, kind, exc)
        elif kind != "BOOKMARK":
            log.warning("watch event skipped %s type=%s reason=unknown type", self._label, kind)
        if version:
            self._resource_version = version

    def _backoff(self) -> float:
        """Exponential delay with jitter, so many gateway replicas do not reconnect in step."""
        settings = self._settings
        ceiling = min(settings.backoff_max_s, settings.backoff_base_s * 2 ** min(self._failures - 1, 30))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


def object_name(obj: Any) -> str:
    """metadata.name of an object; ObjectError when there is none."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        raise ObjectError("object has no metadata.name")
    return name


def _check_status(response: aiohttp.ClientResponse) -> None:
    if response.status == 410:
        raise _Expired("http 410")
    if response.status != 200:
        raise _Broken(f"http {response.status} {response.reason}")


def _resource_version_of(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version else None
