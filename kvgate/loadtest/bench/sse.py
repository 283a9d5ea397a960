"""Reading a streamed (SSE) chat completion: shared by the benchmark client and the locustfile."""

from __future__ import annotations

from collections.abc import Callable

import orjson

_ERROR_TEXT_CHARS = 200


class ChatStream:
    """Folds the lines of a streamed chat completion: content deltas with their arrival times, an error, the end."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.text: list[str] = []
        self.delta_times: list[float] = []  # clock() at each non-empty content delta
        self.error: str | None = None
        self.done = False

    def feed(self, line: bytes) -> None:
        """Take one line of the body; anything but a `data:` line is ignored."""
        if not line.startswith(b"data: "):
            return
        payload = line[6:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        event = orjson.loads(payload)
        if "error" in event:
            self.error = f"stream error: {str(event['error'])[:_ERROR_TEXT_CHARS]}"
            return
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.delta_times.append(self._clock())
                self.text.append(content)

    def finish(self) -> None:
        """Mark a stream that ended without `[DONE]` or an error event as failed."""
        if self.error is None and not self.done:
            self.error = "stream ended without [DONE]"
