"""Structured logging: one JSON object per line, one line per event."""

from __future__ import annotations

import logging
import sys
import time

import orjson


class JsonLineFormatter(logging.Formatter):
    """Formats a record as `{"ts", "level", "logger", "msg"}` (plus `exc` only for unexpected errors)."""

    def format(self, record: logging.LogRecord) -> str:
        """Render one record."""
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure_logging(level: str) -> None:
    """Send every logger's records to stderr as JSON lines at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
