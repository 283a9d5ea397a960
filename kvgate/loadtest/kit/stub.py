"""Stub replicas that answer instantly, so a benchmark through kvgate measures kvgate itself.

Run: python -m kvgate.loadtest.kit.stub --ports 9001,9002"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvloop
from aiohttp import web

from kvgate.loadtest.kit.vllm_metrics_page import DEFAULT_MODEL, EngineLoad, render_vllm_metrics
from kvgate.simulator.responses import DONE_EVENT, SSE_HEADERS, sse

CHUNKS_HEADER = "x-bench-chunks"  # SSE events in a streamed answer
INTERVAL_HEADER = "x-bench-chunk-interval-ms"  # pause between two events, as a decoding engine would make
STREAM_MARKER = b'"stream":true'  # orjson's spelling; the stub never parses the body, which keeps it cheap
_MAX_BODY_BYTES = 64 * 1024 * 1024


def stub_headers(chunks: int, interval_ms: float) -> dict[str, str]:
    """Headers of a chat request whose streamed answer from a stub has `chunks` events, `interval_ms` apart."""
    return {"Content-Type": "application/json", CHUNKS_HEADER: str(chunks), INTERVAL_HEADER: str(interval_ms)}

_COMPLETION = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": DEFAULT_MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001},
})
_CHUNK = sse({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000,
              "model": DEFAULT_MODEL, "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}]})
_MODELS = orjson.dumps({"object": "list", "data": [
    {"id": DEFAULT_MODEL, "object": "model", "created": 1700000000, "owned_by": "vllm", "root": DEFAULT_MODEL,
     "parent": None, "max_model_len": 131072, "permission": []}]})


async def chat(request: web.Request) -> web.StreamResponse:
    """A chat completion at once, or an SSE stream of `x-bench-chunks` events when the body asks to stream."""
    raw = await request.read()
    if STREAM_MARKER not in raw:
        return web.Response(body=_COMPLETION, content_type="application/json")
    chunks = int(request.headers.get(CHUNKS_HEADER, "16"))
    interval_s = float(request.headers.get(INTERVAL_HEADER, "0")) / 1000
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    for _ in range(chunks):
        if interval_s:
            await asyncio.sleep(interval_s)
        await response.write(_CHUNK)
    await response.write(DONE_EVENT)
    await response.write_eof()
    return response


def build_app() -> web.Application:
    """The stub's routes: chat completions, /v1/models and a static vLLM /metrics page."""
    page = render_vllm_metrics([EngineLoad(running=1, kv_cache_usage=0.1)]).encode()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=_MODELS, content_type="application/json")

    app = web.Application(client_max_size=_MAX_BODY_BYTES)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(ports: list[int], host: str) -> None:
    """Serve one stub per port until cancelled."""
    runner = web.AppRunner(build_app(), access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, host, port, backlog=1024).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    """Parse the ports and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", required=True, help="comma-separated ports, one stub replica each")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    uvloop.run(serve([int(p) for p in args.ports.split(",")], args.host))


if __name__ == "__main__":
    main()
