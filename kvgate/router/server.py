"""The aiohttp application, its listeners, and the SIGTERM drain."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvgate.router.config import GatewayConfig
from kvgate.router.auth import auth_middleware
from kvgate.router.errors import GatewayError, error_response
from kvgate.router.gateway import Gateway
from kvgate.router.handlers import Handlers
from kvgate.router.pipeline import RequestPipeline
from kvgate.router.limits import ConnectionGuard, ConnectionLimits, raise_open_file_limit
from kvgate.router.requests import ROUTE_KINDS

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer routing errors (404, 405, ...) and unexpected failures as OpenAI-style JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no route for {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(GatewayError(exc.status, message, headers=headers))


def build_apps(gateway: Gateway) -> tuple[web.Application, web.Application | None]:
    """The public application and, when an admin listener is configured, the admin one."""
    handlers = Handlers(gateway)
    middlewares = [openai_errors]
    if gateway.keys:
        middlewares.append(auth_middleware(gateway.keys, gateway.metrics.auth_failures))
    app = web.Application(middlewares=middlewares, client_max_size=gateway.config.max_body_bytes)
    app.cleanup_ctx.append(gateway.lifecycle)
    pipeline = RequestPipeline(gateway)
    for path in ROUTE_KINDS:
        app.router.add_post(path, pipeline.handle)
    app.router.add_get("/v1/models", handlers.models)
    admin_routes = [("/healthz", handlers.healthz), ("/readyz", handlers.readyz),
                    ("/metrics", handlers.metrics), ("/debug/fleet", handlers.debug_fleet)]
    admin = web.Application(middlewares=[openai_errors]) if gateway.config.admin_listen else None
    for path, handler in admin_routes:
        # Probes stay on the public port so kubelet reaches them there; /metrics and /debug/* move.
        public = path in ("/healthz", "/readyz") or admin is None
        (app if public else admin).router.add_get(path, handler)
        if admin is not None and public:
            admin.router.add_get(path, handler)
    return app, admin


class GatewayServer:
    """Runs one gateway: listeners up, serve until SIGTERM/SIGINT or stop(), then drain and close."""

    def __init__(self, config: GatewayConfig, gateway: Gateway) -> None:
        self.config = config
        self.gateway = gateway
        self._stop = asyncio.Event()
        self._runners: list[web.AppRunner] = []
        self._listeners: list[asyncio.Server] = []
        self.guards: list[ConnectionGuard] = []  # each listener's open-connection count and limits, public first
        self.addresses: list[tuple[str, int]] = []  # bound (host, port) of each listener, public first
        self.picker = None  # the endpoint picker's gRPC server (kvgate.router.picker.PickerServer) when configured

    async def start(self) -> None:
        """Open the listeners and start the background parts."""
        app, admin = build_apps(self.gateway)
        listeners = [(app, self.config.listen_address)]
        if admin is not None and self.config.admin_address is not None:
            listeners.append((admin, self.config.admin_address))
        limits = ConnectionLimits.from_config(self.config)
        limits = dataclasses.replace(limits, max_connections=raise_open_file_limit(limits.max_connections))
        loop = asyncio.get_running_loop()
        for application, (host, port) in listeners:
            runner = web.AppRunner(application, handle_signals=False, handler_cancellation=True,
                                   shutdown_timeout=self.config.drain_timeout)
            await runner.setup()
            self._runners.append(runner)
            # The guard, not a TCPSite, makes each connection's protocol: it caps them and times their reads.
            guard = ConnectionGuard(runner.server, limits)
            listener = await loop.create_server(guard, host, port, backlog=1024, reuse_address=True)
            self.guards.append(guard)
            self._listeners.append(listener)
            self.addresses.append(tuple(listener.sockets[0].getsockname()[:2]))
        if self.config.picker_address is not None:
            from kvgate.router.picker import PickerServer  # grpc and Envoy's API: loaded only for the picker

            self.picker = PickerServer(self.gateway, *self.config.picker_address)
            await self.picker.start()
        log.info("gateway listening addresses=%s policy=%s discovery=%s", self.addresses, self.config.policy,
                 self.config.discovery)

    def request_stop(self) -> None:
        """Begin the drain (what SIGTERM does)."""
        self._stop.set()

    async def serve(self) -> None:
        """Serve until asked to stop, then drain: readiness off, drain delay, close, wait for in-flight."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError):
                pass  # not the main thread (tests): stop() is called directly
        await self._stop.wait()
        await self.drain()

    async def drain(self) -> None:
        """Readiness turns 503 now; new requests are taken for drain_delay; then in-flight ones finish."""
        if self.gateway.draining:
            return
        self.gateway.draining = True
        log.info("draining delay_s=%s timeout_s=%s", self.config.drain_delay, self.config.drain_timeout)
        await asyncio.sleep(self.config.drain_delay)
        # Closing the listeners first, then waiting up to shutdown_timeout for running handlers.
        for listener in self._listeners:
            listener.close()
        if self.picker is not None:
            await self.picker.stop(self.config.drain_timeout)
        for runner in self._runners:
            await runner.cleanup()
        log.info("drained; exiting")
