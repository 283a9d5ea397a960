"""API keys: the keys file, the store that reloads it when it changes, and the middleware that requires a key."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from aiohttp import hdrs, web
from prometheus_client import Counter

from kvgate.router.config import ConfigError
from kvgate.router.errors import GatewayError, error_response

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PRIORITY_CLASSES = ("interactive", "batch")
MIN_KEY_CHARS = 16
SHA256_PREFIX = "sha256:"
# Names reach logs and may become metric labels: keep them short and free of anything a parser could trip on.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")  # what a Bearer token can carry in a header
_FIELDS = ("name", "key", "priority", "requests_per_minute", "tokens_per_minute")
# Routes that answer without a key (probes, and metrics/debug when no admin port is configured).
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_OPEN_PREFIX = "/debug/"
# Once the gateway has checked a key, the replicas must not see it: forwardable(headers, CREDENTIAL_HEADERS).
CREDENTIAL_HEADERS = frozenset({"authorization"})


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One API key as the gateway knows it: its name, default priority class and limits, never its secret."""

    name: str
    priority: str | None = None  # default class for this key's requests; None: the gateway's default
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


KEY_INFO = web.RequestKey("kvgate_key", KeyInfo)  # set on every request the middleware lets through


class KeysFileError(ConfigError):
    """The API keys file is unreadable or invalid; the message names the file and the entry, never a secret."""


def key_digest(secret: str) -> bytes:
    """SHA-256 of a key: how keys are stored and looked up."""
    return hashlib.sha256(secret.encode("utf-8")).digest()


def parse_keys(data: Any, priority_classes: Sequence[str] = PRIORITY_CLASSES) -> dict[bytes, KeyInfo]:
    """Validate a loaded keys file (a list of key entries) into KeyInfo by key digest."""
    if data is None:
        return {}
    if not isinstance(data, list):
        raise KeysFileError("must be a YAML list of keys, each {name, key, priority?, requests_per_minute?, "
                            "tokens_per_minute?}")
    keys: dict[bytes, KeyInfo] = {}
    names: set[str] = set()
    for number, entry in enumerate(data, start=1):
        info, digest = _parse_entry(entry, f"entry {number}", priority_classes)
        if info.name in names:
            raise KeysFileError(f"entry {number}: duplicate name {info.name!r}")
        if digest in keys:
            raise KeysFileError(f"key {info.name!r}: same secret as key {keys[digest].name!r}")
        names.add(info.name)
        keys[digest] = info
    return keys


def _parse_entry(entry: Any, where: str, priority_classes: Sequence[str]) -> tuple[KeyInfo, bytes]:
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: must be a mapping with at least name and key")
    unknown = sorted(str(field) for field in entry if field not in _FIELDS)
    if unknown:
        raise KeysFileError(f"{where}: unknown field(s) {', '.join(unknown)}; expected {', '.join(_FIELDS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KeysFileError(f"{where}: 'name' must be 1-64 letters, digits, '.', '_' or '-', starting with a "
                            f"letter or digit")
    where = f"key {name!r}"
    digest = _secret_digest(entry.get("key"), where)
    priority = entry.get("priority")
    if priority is not None and priority not in priority_classes:
        raise KeysFileError(f"{where}: priority must be one of {', '.join(priority_classes)}, got {priority!r}")
    limits = {field: _positive_int(entry.get(field), f"{where}: {field}")
              for field in ("requests_per_minute", "tokens_per_minute")}
    return KeyInfo(name=name, priority=priority, **limits), digest


def _secret_digest(value: Any, where: str) -> bytes:
    """The digest a `key:` field stands for; error messages never quote the value."""
    if not isinstance(value, str) or not value:
        raise KeysFileError(f"{where}: 'key' is required and must be a string (quote it in YAML)")
    if value.startswith(SHA256_PREFIX):
        hex_digest = value[len(SHA256_PREFIX):]
        if not _HEX_DIGEST.fullmatch(hex_digest):
            raise KeysFileError(f"{where}: a {SHA256_PREFIX} key must be followed by 64 hex digits")
        return bytes.fromhex(hex_digest)
    if not _VISIBLE_ASCII.fullmatch(value):
        raise KeysFileError(f"{where}: 'key' may hold only visible ASCII characters (no spaces)")
    if len(value) < MIN_KEY_CHARS:
        raise KeysFileError(f"{where}: 'key' is too short: use at least {MIN_KEY_CHARS} random characters "
                            f"(e.g. `openssl rand -hex 32`)")
    return key_digest(value)


def _positive_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeysFileError(f"{where}: must be a whole number of at least 1, got {value!r}")
    return value


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header value, or None for any other value."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass(frozen=True, slots=True)
class _FileState:
    """What identifies one version of the keys file: stat fields, then the content's hash."""

    signature: tuple[int, int, int]  # (inode, size, mtime in ns) of the file the path resolves to
    content_hash: bytes


class ApiKeyStore:
    """The keys of one keys file, looked up by the digest of a presented token; reloads when the file changes."""

    def __init__(self, path: str, *, poll_s: float = 1.0,
                 priority_classes: Sequence[str] = PRIORITY_CLASSES) -> None:
        self.path = path
        self._poll_s = poll_s
        self._priority_classes = tuple(priority_classes)
        self._missing_logged = False
        try:
            signature = self._stat()
            content = self._read()
            keys = self._parse(content)
        except OSError as exc:
            raise KeysFileError(f"api_keys_file: cannot read {path}: {exc.strerror}") from None
        self._state = _FileState(signature, hashlib.sha256(content).digest())
        self._keys = keys
        log.info("api keys loaded path=%s keys=%d", path, len(keys))
        if not keys:
            log.warning("api keys file lists no keys path=%s; every request will be refused", path)

    @property
    def names(self) -> list[str]:
        """The names of the keys now in force, sorted."""
        return sorted(info.name for info in self._keys.values())

    def authenticate(self, authorization: str | None) -> KeyInfo | None:
        """The key an Authorization header value presents, or None when it presents no valid key."""
        token = bearer_token(authorization)
        if token is None:
            return None
        # Looking up the token's SHA-256 compares digests, never the secret itself: a client cannot choose a
        # digest's leading bytes, so how long a miss takes tells it nothing about any stored key.
        return self._keys.get(key_digest(token))

    def reload_if_changed(self) -> bool:
        """Reload when the file's stat or content changed; keep the current keys if it is missing or invalid."""
        try:
            signature = self._stat()
            if signature == self._state.signature:
                return False
            content = self._read()
        except OSError as exc:
            if not self._missing_logged:
                log.warning("api keys file unreadable path=%s error=%s; keeping %d keys", self.path,
                            exc.strerror, len(self._keys))
                self._missing_logged = True
            return False
        self._missing_logged = False
        state = _FileState(signature, hashlib.sha256(content).digest())
        previous, self._state = self._state, state  # an invalid version is reported once, not every poll
        if state.content_hash == previous.content_hash:
            return False
        try:
            keys = self._parse(content)
        except KeysFileError as exc:
            log.warning("api keys reload rejected path=%s error=%s; keeping %d keys", self.path, exc,
                        len(self._keys))
            return False
        before, after = set(self.names), {info.name for info in keys.values()}
        self._keys = keys
        log.info("api keys reloaded path=%s keys=%d added=%s removed=%s", self.path, len(keys),
                 ",".join(sorted(after - before)) or "-", ",".join(sorted(before - after)) or "-")
        return True

    async def run(self) -> None:
        """Poll the file every `poll_s` seconds and reload it on change, until cancelled."""
        while True:
            await asyncio.sleep(self._poll_s)
            self.reload_if_changed()

    def _stat(self) -> tuple[int, int, int]:
        # os.stat follows symlinks: a Kubernetes Secret volume swaps the `..data` link, which changes the inode.
        stat = os.stat(self.path)
        return stat.st_ino, stat.st_size, stat.st_mtime_ns

    def _read(self) -> bytes:
        with open(self.path, "rb") as handle:
            return handle.read()

    def _parse(self, content: bytes) -> dict[bytes, KeyInfo]:
        try:
            data = yaml.safe_load(content)
        except yaml.YAMLError as exc:
            # The YAML error quotes the offending line, which may hold a secret: report the position only.
            mark = getattr(exc, "problem_mark", None)
            position = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise KeysFileError(f"api_keys_file: {self.path} is not valid YAML{position}") from None
        try:
            return parse_keys(data, self._priority_classes)
        except KeysFileError as exc:
            raise KeysFileError(f"api_keys_file: {self.path}: {exc}") from None


def _is_open(request: web.Request) -> bool:
    """Whether the request matched a route that needs no key; anything else, unknown paths included, does."""
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else None
    return path is not None and (path in _OPEN_PATHS or path.startswith(_OPEN_PREFIX))


def auth_middleware(store: ApiKeyStore,
                    failures: Counter) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Middleware that answers 401 unless the request presents a key of `store` (probes and metrics excepted).

    Each refusal is logged and counted in `failures` by its reason.
    """

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if _is_open(request):
            return await handler(request)
        try:
            request[KEY_INFO] = require_key(store, request.headers.get(hdrs.AUTHORIZATION), failures,
                                            f"path={request.path} peer={request.remote}")
        except GatewayError as error:
            return error_response(error)
        return await handler(request)

    return require_api_key


def require_key(store: ApiKeyStore, authorization: str | None, failures: Counter, where: str) -> KeyInfo:
    """The key an Authorization header value presents; else GatewayError(401), logged with `where` and counted."""
    key = store.authenticate(authorization)
    if key is not None:
        return key
    reason = "missing" if authorization is None else "invalid"
    log.info("auth rejected %s reason=%s", where, reason)
    failures.labels(reason).inc()
    message = ("an API key is required: send it as 'Authorization: Bearer <key>'" if authorization is None
               else "invalid API key")
    raise GatewayError(401, message, headers={"WWW-Authenticate": 'Bearer realm="kvgate"'})
