"""The request stage that computes a prompt's token ids once, as its engine will, for precise routing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping

from kvgate.engine.tokenizer import EngineTokenizer
from kvgate.policies.prefix_keys import instruction_messages
from kvgate.router.requests import InferenceRequest

log = logging.getLogger(__name__)


class RequestTokenizer:
    """Per served model, the engine's tokenizer; long prompts are tokenized on a worker thread."""

    def __init__(self, tokenizers: Mapping[str, EngineTokenizer], offload_bytes: int) -> None:
        self._tokenizers = dict(tokenizers)
        self._offload_bytes = offload_bytes

    @classmethod
    def load(cls, directories: Mapping[str, str], offload_bytes: int) -> RequestTokenizer:
        """Load each model's tokenizer directory (at start: a bad one stops the gateway)."""
        return cls({model: EngineTokenizer.load(path) for model, path in directories.items()}, offload_bytes)

    def for_model(self, model: str) -> EngineTokenizer | None:
        """The model's tokenizer; with a single one configured, it also serves the model's LoRA adapters."""
        found = self._tokenizers.get(model)
        if found is None and len(self._tokenizers) == 1:
            found = next(iter(self._tokenizers.values()))
        return found

    async def tokenize(self, request: InferenceRequest) -> InferenceRequest:
        """The request with its token ids, or unchanged (routed approximately) when they cannot be computed."""
        tokenizer = self.for_model(request.model)
        if tokenizer is None or request.kind not in ("chat", "completion"):
            return request
        instructions = instruction_messages(request.payload) if request.kind == "chat" else 0
        try:
            if request.info.body_bytes > self._offload_bytes:
                loop = asyncio.get_running_loop()
                ids, anchor = await loop.run_in_executor(None, _tokenized, tokenizer, request, instructions)
            else:
                ids, anchor = _tokenized(tokenizer, request, instructions)
        except Exception as exc:  # noqa: BLE001 - a body the template or tokenizer refuses: the engine will answer it
            log.debug("tokenization failed model=%s: %s", request.model, exc)
            return request
        if not ids:
            return request
        return dataclasses.replace(request, info=dataclasses.replace(request.info, token_ids=tuple(ids),
                                                                     anchor_tokens=anchor))


def _tokenized(tokenizer: EngineTokenizer, request: InferenceRequest,
               instructions: int) -> tuple[list[int] | None, int]:
    """The request's token ids, and how many of them its `instructions` leading messages (its anchor) account for."""
    ids = tokenizer.request_ids(request.kind, request.payload)
    anchor = tokenizer.leading_messages_length(request.payload, instructions, ids) if ids and instructions else 0
    return ids, anchor
