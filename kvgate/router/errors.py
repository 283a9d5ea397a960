"""OpenAI-shaped error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class GatewayError(Exception):
    """An expected failure that becomes an OpenAI-style error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The JSON bytes of an OpenAI-style error (code is the HTTP status, as vLLM does)."""
    error = {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}
    return orjson.dumps({"error": error})


def error_response(error: GatewayError) -> web.Response:
    """Render a GatewayError as an HTTP response."""
    return web.Response(status=error.status, body=error_body(error.status, error.message, error.param),
                        content_type="application/json", headers=error.headers)
