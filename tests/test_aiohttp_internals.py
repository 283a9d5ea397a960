"""The aiohttp internals kvgate's connection guard (kvgate/router/limits.py) reads still exist.

aiohttp is pinned below the next minor version; raising the pin means this test must still pass.
"""

from __future__ import annotations

from aiohttp import web_protocol


def test_request_handler_still_counts_and_queues_request_heads_where_the_guard_reads_them():
    slots = {name for cls in web_protocol.RequestHandler.__mro__ for name in getattr(cls, "__slots__", ())}
    assert {"_request_count", "_messages", "_loop"} <= slots
    source = web_protocol.RequestHandler.data_received.__code__.co_names
    assert "_request_count" in source and "_messages" in source  # data_received is where both move
