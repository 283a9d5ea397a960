"""Reading and checking an inference request body, once, into the object every later stage takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
class InferenceRequest:
    """One inference request as the gateway understood it: read once, then carried through every stage."""

    kind: str  # chat, completion or embedding
    info: RequestInfo  # model, class, flow, stream flag and prompt keys: what admission and routing read
    rank: int  # its class's place in the priority order, 0 = most important
    completion_tokens: int  # tokens it may generate: max_completion_tokens (else max_tokens) x n, 0 when unbounded
    upstream_body: bytes  # what goes to the replica: the client's bytes, or re-encoded once with vLLM's priority
    payload: Mapping[str, Any]  # the decoded body, for the tokenizer stage only

    @property
    def model(self) -> str:
        """The model (or LoRA adapter) it names."""
        return self.info.model

    def at_rate(self, chars_per_token: float | None) -> InferenceRequest:
        """The request with its prompt counted at `chars_per_token` (RequestInfo.at_rate)."""
        info = self.info.at_rate(chars_per_token)
        return self if info is self.info else dataclasses.replace(self, info=info)


def parse_request(path: str, raw: bytes, priority_class: str, rank: int, routing: RoutingConfig,
                  flow: str = DEFAULT_FLOW, upstream_priority: bool = False) -> InferenceRequest:
    """Parse and sanity-check a body of a request of `flow` (its fairness id); GatewayError(400) names a bad field.

    With `upstream_priority` the body sent upstream carries vLLM's `priority`: the class's rank (lower runs earlier).
    """
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
    upstream = orjson.dumps({**body, "priority": rank}) if upstream_priority else raw
    return InferenceRequest(kind=kind, info=info, rank=rank, completion_tokens=completion_tokens(body),
                            upstream_body=upstream, payload=body)


def completion_tokens(body: Mapping[str, Any]) -> int:
    """Tokens a body asks to generate: vLLM's max_completion_tokens supersedes max_tokens; `n` completions each get
    that many. 0 when it sets no bound or a malformed one (the replica will refuse it)."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    return _count(limit, 0) * _count(body.get("n"), 1)


def _count(value: object, default: int) -> int:
    """A non-negative integer field, or `default` when it is absent or malformed."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
