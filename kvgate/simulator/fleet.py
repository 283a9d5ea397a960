"""SimFleet: several simulated replicas served from one process, each on its own port."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from aiohttp import web

from kvgate.simulator.options import SimOptions
from kvgate.simulator.server import SimReplica

log = logging.getLogger(__name__)

# stop() aborts in-flight sequences first, so handlers end promptly; this only bounds stragglers.
_STOP_GRACE_SECONDS = 2.0


class SimFleet:
    """Running simulated replicas and the base URLs they listen on."""

    def __init__(self, replicas: list[SimReplica], runners: list[web.AppRunner], urls: list[str]) -> None:
        self.replicas = replicas
        self.urls = urls
        self._runners = runners

    @classmethod
    async def start(cls, ports: Sequence[int], options: SimOptions, host: str = "127.0.0.1") -> SimFleet:
        """Start one replica per port (0 picks a free port) and return once all are listening."""
        fleet = cls([], [], [])
        try:
            for port in ports:
                replica = SimReplica(options)
                runner = web.AppRunner(replica.build_app(), access_log=None, shutdown_timeout=_STOP_GRACE_SECONDS)
                await runner.setup()
                fleet._runners.append(runner)
                await web.TCPSite(runner, host, port).start()
                bound_port = runner.addresses[0][1]
                fleet.replicas.append(replica)
                if options.kv_events:
                    await replica.start_kv_events(host, port and bound_port)
                fleet.urls.append(f"http://{host}:{bound_port}")
                log.info("sim replica listening url=%s", fleet.urls[-1])
        except BaseException:
            await fleet.stop()
            raise
        return fleet

    async def stop(self) -> None:
        """Stop every replica, aborting whatever is still in flight."""
        runners, self._runners = self._runners, []
        await asyncio.gather(*(runner.cleanup() for runner in runners))


async def serve_fleet(ports: Sequence[int], options: SimOptions, host: str = "127.0.0.1") -> None:
    """Serve a fleet until cancelled."""
    fleet = await SimFleet.start(ports, options, host)
    try:
        await asyncio.Event().wait()
    finally:
        await fleet.stop()
