"""Limits on client connections: how many may be open, and how long a client may take to send a request."""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestPayloadError

from kvgate.router.config import GatewayConfig
from kvgate.router.errors import GatewayError, error_body, error_response

log = logging.getLogger(__name__)

# aiohttp's HTTP parser refuses a longer request line or header field, or more header fields.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 16384
MAX_HEADERS = 128
# How long a refused connection may take to read its 503 before it is closed anyway, and how many may wait
# so at once (max_connections, but at least this many) before further ones are dropped unanswered.
_REFUSAL_LINGER_S = 1.0
_REFUSALS_AT_ONCE = 1024
# Each served client socket may hold an upstream socket, and refused ones linger briefly: about 3 files each,
# plus some for the scrapers, watchers and the process itself.
_FILES_PER_CONNECTION = 3
_SPARE_FILES = 1024


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How many connections a listener serves at once and how long a client may take to send a request."""

    max_connections: int
    header_timeout: float  # from connecting, or from the first byte of a later request, to the end of its head
    body_timeout: float  # longest silence while a request body arrives
    keepalive_timeout: float  # an idle keep-alive connection is closed after this long

    @classmethod
    def from_config(cls, config: GatewayConfig) -> ConnectionLimits:
        """The limits the configuration sets."""
        return cls(config.max_connections, config.header_timeout, config.body_timeout, config.keepalive_timeout)


class BodyReadTimeout(GatewayError, TimeoutError):
    """The client went silent in the middle of its request body.

    A GatewayError so the handler reading the body answers 408; a TimeoutError so aiohttp's lingering read of a
    body no handler wanted ends quietly on it.
    """

    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body stalled: nothing arrived for {timeout:g}s")


class ConnectionGuard:
    """Protocol factory of one listener: time-limited HTTP handlers up to max_connections, a 503 beyond."""

    def __init__(self, server: web.Server, limits: ConnectionLimits) -> None:
        self.server = server
        self.limits = limits
        self.served = 0  # connections handed to an HTTP handler and not yet closed
        self.refusing = 0  # refused connections still being told so

    def __call__(self) -> asyncio.Protocol:
        """The protocol for one accepted connection."""
        if self.served >= self.limits.max_connections:
            return _Refusal(self)
        self.served += 1
        return GuardedRequestHandler(self)


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's HTTP/1.1 server protocol with head and body read timeouts and OpenAI-style parse errors."""

    __slots__ = ("_guard", "_limits", "_head_timer", "_body", "_body_deadline", "_body_timer", "_closing")

    def __init__(self, guard: ConnectionGuard) -> None:
        limits = guard.limits
        super().__init__(guard.server, loop=asyncio.get_running_loop(), access_log=None,
                         keepalive_timeout=limits.keepalive_timeout, max_line_size=MAX_LINE_BYTES,
                         max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS)
        self._guard: ConnectionGuard | None = guard  # None once the connection is closed and uncounted
        self._limits = limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # the body the newest request is still sending
        self._body_deadline = 0.0
        self._body_timer: asyncio.TimerHandle | None = None
        self._closing = False  # answered already; whatever else the client sends is ignored

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_head_timer()  # a client that connects must send its first request in time too

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._guard is not None:
            self._guard.served -= 1
            self._guard = None
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        was_reading_body = self._reading_body()
        # aiohttp counts each request head it parses in _request_count and queues it in _messages.
        heads_before = self._request_count
        super().data_received(data)
        if self._closing:
            return
        if self._request_count != heads_before:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if was_reading_body:
                # A head cannot follow an unfinished body: aiohttp queued its parse error as the next request
                # while the handler still waits for the body. Fail that wait so the handler answers now.
                self._body.set_exception(RequestPayloadError("the request body is malformed"))
            self._body = self._messages[-1][1]
        elif data and not was_reading_body:
            self._start_head_timer()  # these bytes begin the next request head
        if self._reading_body():
            self._extend_body_deadline()
        else:
            self._body = None

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Answer an unparsable request, or a handler failure, with an OpenAI-style error and close."""
        if request.writer.output_size > 0:
            # Part of a response is out: no error can follow it, so aiohttp drops the connection.
            raise ConnectionError("response already started")
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            status, message = _malformed(exc)
            log.info("malformed request peer=%s status=%d reason=%s", request.remote, status, message)
        else:
            if exc is not None:
                self.log_exception("request failed peer=%s", request.remote, exc_info=exc)
            message = HTTPStatus(status).phrase
        response = error_response(GatewayError(status, message))
        response.force_close()
        return response

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        """Send a response; an HTTP error aiohttp raised outside the middlewares (an unknown Expect) goes as JSON."""
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            resp = error_response(GatewayError(resp.status, resp.text or resp.reason))
        return await super().finish_response(request, resp, start_time)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """Log an unexpected failure with its traceback; a malformed body is expected, so one line."""
        failure = kwargs.get("exc_info")
        if isinstance(failure, (HttpProcessingError, RequestPayloadError)):
            log.info("malformed request body; closing peer=%s reason=%s", self.peername, _malformed(failure)[1])
            return
        super().log_exception(*args, **kwargs)

    def _reading_body(self) -> bool:
        return self._body is not None and not self._body.is_eof()

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self._loop.call_later(self._limits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        log.info("request head too slow; closing peer=%s timeout_s=%g", self.peername,
                 self._limits.header_timeout)
        self.force_close()

    def _extend_body_deadline(self) -> None:
        self._body_deadline = self._loop.time() + self._limits.body_timeout
        if self._body_timer is None:
            self._body_timer = self._loop.call_at(self._body_deadline, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._reading_body():
            return
        if self.transport is not None and not self.transport.is_reading():
            # Flow control paused reading because the handler has not read what came: not the client's silence.
            self._extend_body_deadline()
            return
        if self._loop.time() < self._body_deadline:  # data came since the timer was set
            self._body_timer = self._loop.call_at(self._body_deadline, self._body_timed_out)
            return
        body, self._body = self._body, None
        timeout = self._limits.body_timeout
        log.info("request body stalled; closing peer=%s timeout_s=%g", self.peername, timeout)
        self._closing = True
        self.close()  # read nothing more; the connection closes once the handler has answered
        body.set_exception(BodyReadTimeout(timeout))


def _malformed(exc: Exception) -> tuple[int, str]:
    """Status and message for a request aiohttp's parser refused."""
    if isinstance(exc, LineTooLong):
        # The parser says which limit was hit: the request line's or a header field's.
        limit = exc.args[1]
        if limit == MAX_FIELD_BYTES:
            return 431, f"a request header field exceeds {limit} bytes"
        return 400, f"the request line exceeds {limit} bytes"
    if not isinstance(exc, HttpProcessingError):
        return 400, "the request body is malformed"
    if exc.message.startswith("Too many headers"):
        return 431, f"the request has more than {MAX_HEADERS} header fields"
    # The parser's message quotes the offending bytes on later lines; the first line names the fault.
    return 400, f"malformed HTTP request: {exc.message.splitlines()[0].rstrip(':')}"


def _refusal_bytes() -> bytes:
    """The whole 503 response a connection over the limit gets, written before any request is read."""
    body = error_body(503, "the gateway has too many open connections; retry shortly")
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


_REFUSAL = _refusal_bytes()


class _Refusal(asyncio.Protocol):
    """A connection over the limit: answered 503 at once, closed when the client has read it."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard: ConnectionGuard | None = guard  # None once uncounted
        self._closer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport) and self._guard is not None
        if self._guard.refusing >= max(self._guard.limits.max_connections, _REFUSALS_AT_ONCE):
            self._guard = None
            transport.abort()  # a flood: even answers would pile up, so drop without one
            return
        self._guard.refusing += 1
        if self._guard.refusing == 1:  # once per burst, not once per connection
            log.warning("refusing connections: limit reached max_connections=%d",
                        self._guard.limits.max_connections)
        transport.write(_REFUSAL)
        # Half-close and wait for the client's EOF: closing with its request unread could reset the
        # connection before the client reads the 503.
        transport.write_eof()
        self._closer = asyncio.get_running_loop().call_later(_REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        """The request is not read."""

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._closer is not None:
            self._closer.cancel()
        if self._guard is not None:
            self._guard.refusing -= 1


def raise_open_file_limit(max_connections: int) -> int:
    """Raise this process's open-file limit to fit max_connections; the connections the limit then affords.

    Where the hard limit is lower than max_connections needs, the listener serves fewer connections at once
    instead of failing on EMFILE when a flood arrives (said once at start, at info: it is the host's setting).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = _files_for(max_connections)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target >= needed:
        return max_connections
    affordable = max(1, (target - _SPARE_FILES) // _FILES_PER_CONNECTION)
    log.info("max_connections lowered to %d to fit the open-file limit %d (asked %d; raise `ulimit -n` for more)",
             affordable, target, max_connections)
    return affordable


def _files_for(connections: int) -> int:
    return _FILES_PER_CONNECTION * connections + _SPARE_FILES
