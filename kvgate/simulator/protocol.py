"""Validation of OpenAI-style request bodies into GenerationRequest, with vLLM's error statuses and shapes."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from kvgate.engine.tokenizer import EngineTokenizer, TokenizerError
from kvgate.simulator.options import SimOptions
from kvgate.simulator.tokens import TokenSeq, render_chat

VOCAB_SIZE = 128_256

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON error object vLLM sends."""
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES[self.status],
                "param": self.param,
                "code": int(self.status),
            }
        }


def _bad_request(message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated chat, completion or embedding request."""

    model: str  # the name the client asked for, echoed in responses
    lora: str | None
    prompts: list[TokenSeq]
    max_tokens: list[int]  # per prompt; 0 for embeddings
    n: int
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None
    request_id: str | None


def _typed(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """body[name] checked against `kind`; JSON booleans are not integers here, as in pydantic's strict fields."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise _bad_request(f"'{name}' must be of type {names}, got {type(value).__name__}")
    return value


def _resolve_model(body: dict[str, Any], options: SimOptions) -> tuple[str, str | None]:
    model = _typed(body, "model", str, options.models[0])
    if model in options.models:
        return model, None
    if model in options.lora_adapters:
        return model, model
    raise ApiError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model")


def _output_lengths(prompts: list[TokenSeq], requested: int | None, options: SimOptions) -> list[int]:
    """Output tokens per prompt, refusing what would overflow the context like vLLM does."""
    lengths = []
    for prompt in prompts:
        room = options.max_model_len - len(prompt)
        if requested is None:
            if room <= 0:
                raise _bad_request(
                    f"This model's maximum context length is {options.max_model_len} tokens. "
                    f"However, your request has {len(prompt)} input tokens. Please reduce the length of the input."
                )
            lengths.append(min(options.default_max_tokens, room))
        elif requested > room:
            raise _bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum context "
                f"length is {options.max_model_len} tokens and your request has {len(prompt)} input tokens "
                f"({requested} > {options.max_model_len} - {len(prompt)})."
            )
        else:
            lengths.append(requested)
    return lengths


def _token_ids(values: list[Any]) -> TokenSeq:
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < VOCAB_SIZE:
            raise _bad_request(f"Token id {value!r} is out of vocabulary")
    return TokenSeq.from_ids(values)


def _text_tokens(text: str, tokenizer: EngineTokenizer | None, add_special_tokens: bool = True) -> TokenSeq:
    """A text prompt's tokens: the model's tokenizer when the replica has one, else 4 characters per token."""
    if tokenizer is None:
        return TokenSeq.from_text(text)
    return TokenSeq.from_ids(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _prompts(value: Any, name: str, tokenizer: EngineTokenizer | None = None) -> list[TokenSeq]:
    """Parse a prompt/input field: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        prompts = [_text_tokens(value, tokenizer)]
    elif isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        prompts = [_text_tokens(item, tokenizer) for item in value]
    elif isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        prompts = [_token_ids(item) for item in value]
    elif isinstance(value, list) and value:
        prompts = [_token_ids(value)]
    else:
        raise _bad_request(
            f"'{name}' must be a string, a list of strings, a list of token ids or a list of token id lists"
        )
    if any(len(prompt) == 0 for prompt in prompts):
        raise _bad_request("The prompt cannot be empty.")
    return prompts


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _bad_request("'messages' is required and must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad_request("each message must be an object with a string 'role'")
        content = message.get("content")
        parts_ok = isinstance(content, list) and all(isinstance(part, dict) for part in content)
        if content is not None and not isinstance(content, str) and not parts_ok:
            raise _bad_request("message 'content' must be a string or a list of content parts")
    return messages


def _generation(
    body: dict[str, Any], options: SimOptions, prompts: list[TokenSeq], requested_tokens: int | None
) -> GenerationRequest:
    """Fields shared by chat and completions."""
    model, lora = _resolve_model(body, options)
    stream = _typed(body, "stream", bool, False)
    stream_options = _typed(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise _bad_request("Stream options can only be defined when `stream=True`.")
    include_usage = _typed(stream_options or {}, "include_usage", bool, False)
    priority = _typed(body, "priority", int, 0)
    if priority != 0 and not options.priority_scheduling:
        raise _bad_request(f"Got priority {priority} but Priority scheduling is not enabled.")
    cache_salt = _typed(body, "cache_salt", str)
    if cache_salt == "":
        raise _bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
    n = _typed(body, "n", int, 1)
    if n < 1:
        raise _bad_request("n must be at least 1.")
    if requested_tokens is not None and requested_tokens < 1:
        raise _bad_request(f"max_tokens must be at least 1, got {requested_tokens}.")
    return GenerationRequest(
        model=model,
        lora=lora,
        prompts=prompts,
        max_tokens=_output_lengths(prompts, requested_tokens, options),
        n=n,
        stream=stream,
        include_usage=include_usage,
        priority=priority,
        cache_salt=cache_salt,
        request_id=_typed(body, "request_id", str),
    )


def parse_chat(body: dict[str, Any], options: SimOptions, tokenizer: EngineTokenizer | None = None) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    messages = _validate_messages(body.get("messages"))
    tools = _typed(body, "tools", list)
    if tokenizer is None:
        prompt = TokenSeq.from_text(render_chat(messages, tools))
    else:
        try:
            prompt = TokenSeq.from_ids(tokenizer.chat_ids(body))
        except TokenizerError as exc:
            raise _bad_request(str(exc)) from None
    # max_completion_tokens supersedes the deprecated max_tokens.
    requested = _typed(body, "max_completion_tokens", int)
    if requested is None:
        requested = _typed(body, "max_tokens", int)
    return _generation(body, options, [prompt], requested)


def parse_completion(body: dict[str, Any], options: SimOptions,
                     tokenizer: EngineTokenizer | None = None) -> GenerationRequest:
    """Validate a /v1/completions body."""
    prompts = _prompts(body.get("prompt"), "prompt", tokenizer)
    return _generation(body, options, prompts, _typed(body, "max_tokens", int))


def parse_embedding(body: dict[str, Any], options: SimOptions,
                    tokenizer: EngineTokenizer | None = None) -> GenerationRequest:
    """Validate a /v1/embeddings body: prefill-only sequences."""
    model, lora = _resolve_model(body, options)
    prompts = _prompts(body.get("input"), "input", tokenizer)
    for prompt in prompts:
        if len(prompt) > options.max_model_len:
            raise _bad_request(
                f"This model's maximum context length is {options.max_model_len} tokens. "
                f"However, you requested {len(prompt)} tokens in the input for embedding generation."
            )
    return GenerationRequest(
        model=model,
        lora=lora,
        prompts=prompts,
        max_tokens=[0] * len(prompts),
        n=1,
        stream=False,
        include_usage=False,
        priority=0,
        cache_salt=None,
        request_id=_typed(body, "request_id", str),
    )
