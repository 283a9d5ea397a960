"""Keeps each replica's served models (base models and LoRA adapters) from its `GET /v1/models`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson

from kvgate.endpoints.types import Endpoint
from kvgate.endpoints.polling import OutageLog, fetch_body, is_current, voided_keys

log = logging.getLogger(__name__)


class ModelLister:
    """Lists models on discovery, then every `refresh_s`; a failed listing keeps the previous set."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],  # the gateway's, open while it runs
        refresh_s: float = 30.0,
        retry_s: float = 2.0,
        timeout_s: float = 2.0,
    ) -> None:
        if min(refresh_s, retry_s, timeout_s) <= 0:
            raise ValueError("model list refresh, retry and timeout must be positive")
        self._session = session
        self._refresh_s = refresh_s
        self._retry_s = retry_s  # sooner than refresh_s: a replica still loading its model should join fast
        self._timeout_s = timeout_s
        self._endpoints: dict[str, Endpoint] = {}
        self._models: dict[str, frozenset[str]] = {}
        self._cards: dict[str, tuple[dict[str, Any], ...]] = {}  # the replicas' own model objects
        self._known: frozenset[str] = frozenset()  # union over endpoints, kept for cheap lookups
        self._due: dict[str, float] = {}  # endpoint key -> event-loop time its next listing is due
        self._outages = OutageLog(log, "model listing")
        self._changed = asyncio.Event()

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """List exactly these endpoints; new ones right away, gone ones forgotten."""
        new = {e.key: e for e in endpoints}
        for key in voided_keys(self._endpoints, new):
            self._models.pop(key, None)
            self._cards.pop(key, None)
            self._due.pop(key, None)
            self._outages.forget(key)
        self._endpoints = new
        self._known = frozenset().union(*self._models.values())
        self._changed.set()

    def models(self, key: str) -> frozenset[str]:
        """Model and adapter ids the endpoint serves; empty while never listed."""
        return self._models.get(key, frozenset())

    def serves(self, model: str) -> bool:
        """Whether any current endpoint lists `model`."""
        return model in self._known

    def model_cards(self) -> list[dict[str, Any]]:
        """The replicas' model objects, one per id (the first replica's), sorted by id: the /v1/models union."""
        cards: dict[str, dict[str, Any]] = {}
        for key in sorted(self._cards):
            for card in self._cards[key]:
                cards.setdefault(card["id"], card)
        return [cards[model_id] for model_id in sorted(cards)]

    async def run(self) -> None:
        """List each endpoint when due until cancelled, waking early when endpoints are added."""
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            now = loop.time()
            await self._list_all([e for key, e in self._endpoints.items() if self._due.get(key, now) <= now])
            next_due = min(self._due.values(), default=None)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(next_due):
                    await self._changed.wait()

    async def refresh_once(self) -> None:
        """List every current endpoint now."""
        await self._list_all(list(self._endpoints.values()))

    async def _list_all(self, endpoints: Sequence[Endpoint]) -> None:
        await asyncio.gather(*(self._list(e) for e in endpoints))

    async def _list(self, endpoint: Endpoint) -> None:
        try:
            body = await fetch_body(self._session(), endpoint.url + "/v1/models", self._timeout_s)
            payload = orjson.loads(body)
            outcome: frozenset[str] | Exception = model_ids(payload)
        except Exception as exc:  # whatever one replica does must not stop the others' listing
            outcome = exc
        if not is_current(self._endpoints, endpoint):
            return  # removed or replaced while the request was in flight
        now = asyncio.get_running_loop().time()
        if isinstance(outcome, Exception):
            self._outages.failed(endpoint.key, outcome)
            self._due[endpoint.key] = now + self._retry_s
        else:
            self._outages.succeeded(endpoint.key)
            if outcome != self._models.get(endpoint.key):
                log.info("models listed endpoint=%s models=%s", endpoint.key, ",".join(sorted(outcome)))
            self._models[endpoint.key] = outcome
            self._cards[endpoint.key] = tuple(card for card in payload["data"] if isinstance(card, dict))
            self._known = frozenset().union(*self._models.values())
            self._due[endpoint.key] = now + self._refresh_s


def model_ids(payload: Any) -> frozenset[str]:
    """Ids in a vLLM `/v1/models` answer: served base models, LoRA adapters and the adapters' parents."""
    try:
        cards = payload["data"]
        return frozenset(card["id"] for card in cards) | frozenset(card["parent"] for card in cards
                                                                   if card.get("parent"))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"unexpected /v1/models shape: {exc!r}") from None
