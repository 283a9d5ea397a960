"""Reading and checking an inference request body, once, into the objects routing needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.policies import build_request_info
from kvgate.policies.config import RoutingConfig
from kvgate.policies.types import DEFAULT_FLOW, RequestInfo
from kvgate.router.errors import GatewayError

# Path -> request kind, and the field that must carry the prompt for that kind.
ROUTE_KINDS = {
    "/v1/chat/completions": ("chat", "messages"),
    "/v1/completions": ("completion", "prompt"),
    "/v1/embeddings": ("embedding", "input"),
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """An inference request as the gateway understood it."""

    kind: str
    body: dict[str, Any]
    raw: bytes  # forwarded byte-identical
    info: RequestInfo


def parse_request(path: str, raw: bytes, priority_class: str, routing: RoutingConfig,
                  flow: str = DEFAULT_FLOW) -> ParsedRequest:
    """Parse and sanity-check a body of a request of `flow` (its fairness id); GatewayError(400) names a bad field."""
    kind, prompt_field = ROUTE_KINDS[path]
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "'model' is required and must be a non-empty string", param="model")
    prompt = body.get(prompt_field)
    if kind == "chat":
        if not isinstance(prompt, list) or not prompt:
            raise GatewayError(400, "'messages' must be a non-empty array", param="messages")
    elif not isinstance(prompt, (str, list)):
        raise GatewayError(400, f"'{prompt_field}' must be a string or an array", param=prompt_field)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be a boolean", param="stream")
    info = build_request_info(kind, body, priority_class, routing, body_bytes=len(raw), flow=flow)
    return ParsedRequest(kind=kind, body=body, raw=raw, info=info)


def with_upstream_priority(parsed: ParsedRequest, classes: Sequence[str]) -> ParsedRequest:
    """The request with vLLM's `priority` set from its class (0 for the most important; lower runs earlier)."""
    body = {**parsed.body, "priority": classes.index(parsed.info.priority_class)}
    return dataclasses.replace(parsed, body=body, raw=orjson.dumps(body))
