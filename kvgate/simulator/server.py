"""SimReplica: one simulated vLLM OpenAI server (engine + HTTP API) as an aiohttp application."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvgate.engine.tokenizer import EngineTokenizer
from kvgate.simulator.engine import AsyncEngine, Generation
from kvgate.simulator.kv_publisher import KvEventPublisher
from kvgate.simulator.metrics import EngineMetrics
from kvgate.simulator.options import SimOptions
from kvgate.simulator.protocol import ApiError, GenerationRequest, parse_chat, parse_completion, parse_embedding
from kvgate.simulator.responses import (
    DONE_EVENT,
    SSE_HEADERS,
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    detokenize,
    embedding_vector,
    model_list,
    now_unix,
    sse,
    usage,
    without_nulls,
)
from kvgate.simulator.scheduler import Sequence

log = logging.getLogger(__name__)

UNAVAILABLE_BODY = {"error": "Server is unavailable. Please try again later."}
_MAX_BODY_BYTES = 64 * 1024 * 1024
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "The request body must be a JSON object")
    return body


class SimReplica:
    """A vLLM OpenAI-compatible server stand-in: same endpoints, errors, SSE framing and /metrics."""

    def __init__(self, options: SimOptions, engine_index: int = 0) -> None:
        self.options = options
        self._metrics = EngineMetrics(options, str(engine_index))
        self._engine = AsyncEngine(options, self._metrics)
        self._tokenizer = EngineTokenizer.load(options.tokenizer) if options.tokenizer else None
        self._ready = asyncio.Event()
        self._shutting_down = False
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._created = now_unix()

    def build_app(self) -> web.Application:
        """The aiohttp application; its lifecycle starts and stops the engine."""
        # Handler cancellation makes a client disconnect abort its sequence at once, as vLLM does.
        app = web.Application(
            middlewares=[self._gate], handler_args={"handler_cancellation": True}, client_max_size=_MAX_BODY_BYTES
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_get("/sim/stats", self._stats)
        app.router.add_post("/sim/reset", self._reset)
        app.router.add_post("/sim/restart", self._restart)
        app.router.add_post("/sim/kv-events/drop", self._drop_events)
        app.cleanup_ctx.append(self._engine_lifecycle)
        # on_shutdown runs before aiohttp waits for open handlers: aborting lets open streams end now.
        app.on_shutdown.append(self._abort_in_flight)
        return app

    def begin_shutdown(self) -> None:
        """Answer new requests 503 (and /health 503) while in-flight ones finish, like `--shutdown-timeout`."""
        if not self._shutting_down:
            self._shutting_down = True
            log.info("sim replica draining in_flight=%d", self._in_flight)

    async def drain(self, timeout: float) -> bool:
        """Begin shutdown and wait up to `timeout` seconds for in-flight requests; True if none remain."""
        self.begin_shutdown()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def stats(self) -> dict[str, int | float]:
        """Exact engine counters since the last reset (requests, prefix cache tokens, aborts, queues, ...)."""
        return self._engine.stats()

    def reset(self) -> None:
        """Zero the stats counters and clear the prefix cache."""
        self._engine.reset()

    @property
    def kv_events(self) -> KvEventPublisher | None:
        """The KV events publisher, once started."""
        return self._engine.publisher

    async def start_kv_events(self, host: str, http_port: int) -> None:
        """Publish KV events on HTTP port + offset, replays on + 2 x offset (ephemeral for port 0)."""
        offset = self.options.kv_events_port_offset
        publisher = KvEventPublisher(self.options.kv_events_topic, self.options.kv_events_buffer)
        port, replay_port = (http_port + offset, http_port + 2 * offset) if http_port else (0, 0)
        await publisher.start(host, port, replay_port)
        self._engine.publisher = publisher

    def cached_block_hashes(self) -> frozenset[int]:
        """The hashes of the blocks the replica's prefix cache holds (what its KV events describe)."""
        return self._engine.core.cache.cached_hashes()

    async def restart_engine(self) -> None:
        """Empty the cache and restart the event publisher (sockets and sequence), as an engine restart does."""
        await self._engine.restart()

    async def _engine_lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        self._engine.start()
        loader = asyncio.create_task(self._load_model())
        yield
        loader.cancel()
        await self._engine.stop()
        if self._engine.publisher is not None:
            await self._engine.publisher.stop()

    async def _load_model(self) -> None:
        await asyncio.sleep(self.options.scaled(self.options.startup_seconds))
        self._ready.set()

    async def _abort_in_flight(self, app: web.Application) -> None:
        self._engine.abort_all()

    @web.middleware
    async def _gate(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Model loading, drain and error shapes for every route but the /sim/ controls."""
        if request.path.startswith("/sim/"):
            return await handler(request)
        if self._shutting_down and request.path != "/metrics":
            return _json(UNAVAILABLE_BODY, HTTPStatus.SERVICE_UNAVAILABLE)
        # While the model loads the socket accepts connections but nothing answers, as with vLLM.
        await self._ready.wait()
        self._in_flight += 1
        self._drained.clear()
        try:
            return await handler(request)
        except ApiError as error:
            return _json(error.body(), error.status)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=HTTPStatus.SERVICE_UNAVAILABLE if self._engine.dead else HTTPStatus.OK)

    async def _models(self, request: web.Request) -> web.Response:
        return _json(model_list(self.options, self._created))

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats(self, request: web.Request) -> web.Response:
        return _json(self.stats())

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return _json(self.stats())

    async def _restart(self, request: web.Request) -> web.Response:
        await self.restart_engine()
        return _json(self.stats())

    async def _drop_events(self, request: web.Request) -> web.Response:
        """Lose the next `count` event batches on the wire (they stay replayable)."""
        if self.kv_events is None:
            return _json({"error": "KV events are off"}, HTTPStatus.NOT_FOUND)
        body = await _read_json(request)
        self.kv_events.drop_next(int(body.get("count", 1)))
        return _json({"dropping": int(body.get("count", 1))})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        params = parse_chat(await _read_json(request), self.options, self._tokenizer)
        return await self._generate(request, params, ChatFormat)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        params = parse_completion(await _read_json(request), self.options, self._tokenizer)
        return await self._generate(request, params, CompletionFormat)

    async def _embeddings(self, request: web.Request) -> web.Response:
        params = parse_embedding(await _read_json(request), self.options, self._tokenizer)
        generation = self._submit(params)
        await self._await_generation(generation)
        data = [
            {"index": index, "object": "embedding", "embedding": embedding_vector(seq.tokens)}
            for index, seq in enumerate(generation.seqs)
        ]
        body = {
            "id": f"embd-{self._request_id(request, params)}",
            "object": "list",
            "created": now_unix(),
            "model": params.model,
            "data": data,
            "usage": usage(generation.seqs, 1),
        }
        return _json(body)

    def _submit(self, params: GenerationRequest) -> Generation:
        loop_time = asyncio.get_running_loop().time()
        seqs = [
            Sequence(
                tokens=prompt,
                max_tokens=max_tokens,
                arrival_time=loop_time,
                lora=params.lora,
                cache_salt=params.cache_salt,
                priority=params.priority,
            )
            for prompt, max_tokens in zip(params.prompts, params.max_tokens, strict=True)
            for _ in range(params.n)
        ]
        return self._engine.submit(seqs)

    async def _await_generation(self, generation: Generation) -> None:
        """Wait for a non-streamed generation; abort it if the client goes away first."""
        try:
            await generation.wait_done()
        finally:
            if not generation.done:
                self._engine.abort(generation)
        if generation.aborted:
            raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "The engine aborted the request.")

    def _usage(self, seqs: list[Sequence], params: GenerationRequest, fmt: ResponseFormat) -> dict[str, Any]:
        return usage(seqs, params.n, fmt, self.options.enable_prompt_tokens_details)

    @staticmethod
    def _request_id(request: web.Request, params: GenerationRequest) -> str:
        return request.headers.get("X-Request-Id") or params.request_id or uuid.uuid4().hex

    async def _generate(
        self, request: web.Request, params: GenerationRequest, fmt: ResponseFormat
    ) -> web.StreamResponse:
        generation = self._submit(params)
        header = {
            "id": f"{fmt.id_prefix}-{self._request_id(request, params)}",
            "object": fmt.chunk_object if params.stream else fmt.object_name,
            "created": now_unix(),
            "model": params.model,
        }
        if not params.stream:
            await self._await_generation(generation)
            choices = [
                fmt.full_choice(index, detokenize(seq.output_ids), seq.finish_reason.value)
                for index, seq in enumerate(generation.seqs)
            ]
            return _json(header | {"choices": choices, "usage": self._usage(generation.seqs, params, fmt)})
        try:
            return await self._stream(request, generation, params, fmt, header)
        finally:
            if not generation.done:
                self._engine.abort(generation)

    async def _stream(
        self,
        request: web.Request,
        generation: Generation,
        params: GenerationRequest,
        fmt: ResponseFormat,
        header: dict[str, Any],
    ) -> web.StreamResponse:
        """Stream tokens as they come: one write per engine step, holding every new token of every choice."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        seqs = generation.seqs
        sent = [0] * len(seqs)  # tokens already streamed per choice
        finished = [False] * len(seqs)
        while not all(finished):
            await generation.changed.wait()
            generation.changed.clear()
            events = []
            for index, seq in enumerate(seqs):
                new_tokens = seq.output_ids[sent[index] :]
                finishing = seq.finished and not finished[index]
                if not new_tokens and not finishing:
                    continue
                if sent[index] == 0 and not finished[index] and (opening := fmt.opening_choice(index)):
                    events.append(sse(header | {"choices": [opening]}))
                sent[index] += len(new_tokens)
                finished[index] = seq.finished
                reason = seq.finish_reason.value if finishing else None
                events.append(sse(header | {"choices": [fmt.stream_choice(index, detokenize(new_tokens), reason)]}))
            if generation.aborted:
                error = ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "The engine aborted the request.")
                await response.write(sse(error.body()) + DONE_EVENT)
                return response
            await response.write(b"".join(events))
        if params.include_usage:
            await response.write(sse(header | {"choices": [], "usage": without_nulls(self._usage(seqs, params, fmt))}))
        await response.write(DONE_EVENT)
        await response.write_eof()
        return response
