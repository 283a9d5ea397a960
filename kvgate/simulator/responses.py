"""Response bodies and SSE events shaped like vLLM's OpenAI server."""

from __future__ import annotations

import time
from typing import Any

import orjson
import xxhash

from kvgate.simulator.options import SimOptions
from kvgate.simulator.scheduler import Sequence
from kvgate.simulator.tokens import TokenSeq, token_text

EMBEDDING_DIM = 32
DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def detokenize(token_ids: list[int]) -> str:
    """Text of generated tokens."""
    return "".join(token_text(token_id) for token_id in token_ids)


def usage(seqs: list[Sequence], n: int, fmt: ResponseFormat | None = None, details: bool = False) -> dict[str, Any]:
    """Token usage of a request whose sequences are grouped n per prompt; with `details` (vLLM's
    --enable-prompt-tokens-details) the prompt tokens found cached and, where `fmt` reports them, those it newly
    cached."""
    prompts = seqs[::n]
    prompt_tokens = sum(seq.num_prompt_tokens for seq in prompts)
    completion_tokens = sum(len(seq.output_ids) for seq in seqs)
    prompt_details = None
    if details:
        created = sum(seq.num_cache_creation_tokens for seq in prompts) if fmt and fmt.reports_cache_creation \
            else None
        prompt_details = {"cached_tokens": sum(max(seq.num_cached_tokens, 0) for seq in prompts),
                          "created_cache_tokens": created, "multimodal_tokens": None}
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": prompt_details,
        "completion_tokens_details": None,
    }


def without_nulls(value: dict[str, Any]) -> dict[str, Any]:
    """The object without its null fields, nested ones too: how vLLM writes a stream's usage chunk."""
    return {key: without_nulls(item) if isinstance(item, dict) else item
            for key, item in value.items() if item is not None}


class ChatFormat:
    """Chat completion objects: message/delta choices, opened by a role chunk when streaming."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    reports_cache_creation = True  # usage.prompt_tokens_details.created_cache_tokens (vLLM's chat serving sets it)

    @staticmethod
    def opening_choice(index: int) -> dict[str, Any] | None:
        """The first streamed choice, announcing the assistant role."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    @staticmethod
    def stream_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        """A streamed choice carrying new text."""
        choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return choice

    @staticmethod
    def full_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        """A choice of a non-streamed response."""
        return {
            "index": index,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "tool_calls": [],
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }


class CompletionFormat:
    """Text completion objects: text choices, no opening chunk."""

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"
    reports_cache_creation = False  # vLLM's completion serving leaves it null

    @staticmethod
    def opening_choice(index: int) -> dict[str, Any] | None:
        """Completions send no opening chunk."""
        return None

    @staticmethod
    def stream_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        """A streamed choice carrying new text."""
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}

    full_choice = stream_choice


ResponseFormat = type[ChatFormat] | type[CompletionFormat]


def model_list(options: SimOptions, created: int) -> dict[str, Any]:
    """The /v1/models body: served names with max_model_len, then LoRA adapters with their parent."""

    def card(model_id: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{xxhash.xxh64_hexdigest(model_id.encode())}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [permission],
        }

    base = options.models[0]
    cards = [card(name, base, None, options.max_model_len) for name in options.models]
    cards += [card(name, f"/adapters/{name}", base, None) for name in options.lora_adapters]
    return {"object": "list", "data": cards}


def embedding_vector(prompt: TokenSeq) -> list[float]:
    """A deterministic unit-length vector for a prompt."""
    seed = prompt.digest()
    raw = [xxhash.xxh64_intdigest(seed.to_bytes(8, "little"), seed=i) / 2**63 - 1.0 for i in range(EMBEDDING_DIM)]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]


def now_unix() -> int:
    """The `created` timestamp of a response."""
    return int(time.time())
