"""Header hygiene between client, gateway and replica: hop-by-hop headers never cross a hop."""

from __future__ import annotations

import itertools
import os
import re

from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade",
})
# Set by the gateway's own HTTP stack for each hop, never copied.
_PER_HOP = frozenset({"host", "content-length", "expect", "date", "server"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# A random per-process prefix and a counter: unique like uuid4, without its cost on every request.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def _dropped(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    """Hop-by-hop names, including those a Connection header declares."""
    declared = {token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")}
    return HOP_BY_HOP | _PER_HOP | declared


def forwardable(headers: CIMultiDictProxy[str], extra_dropped: frozenset[str] = frozenset()) -> CIMultiDict[str]:
    """A copy of `headers` without hop-by-hop and per-hop headers, nor `extra_dropped` (lower-case names)."""
    dropped = _dropped(headers) | extra_dropped
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lowered = name.lower()
        if lowered not in dropped and not lowered.startswith("proxy-"):
            out.add(name, value)
    return out


def request_id(headers: CIMultiDictProxy[str]) -> str:
    """The client's x-request-id when it is a sane token, else a fresh one."""
    given = headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"
