"""One simulated vLLM replica with a pod's lifecycle: start on a fresh port, drain and stop, or die at once."""

from __future__ import annotations

import logging

from aiohttp import web

from kvgate.simulator import SimOptions, SimReplica

log = logging.getLogger(__name__)

_HOST = "127.0.0.1"
# After a drain nothing is in flight; this only bounds a stop that follows a drain timeout.
_STOP_GRACE_SECONDS = 1.0


class RestartableReplica:
    """A SimReplica served on its own loopback port, stopped gracefully or killed like a pod."""

    def __init__(self, name: str, options: SimOptions) -> None:
        self.name = name
        self.sim = SimReplica(options)
        self.url = ""
        self._runner: web.AppRunner | None = None

    @classmethod
    async def start(cls, name: str, options: SimOptions) -> RestartableReplica:
        """Listen on a free port; the API answers once `options.startup_seconds` (model load) have passed."""
        replica = cls(name, options)
        runner = web.AppRunner(replica.sim.build_app(), access_log=None, shutdown_timeout=_STOP_GRACE_SECONDS)
        await runner.setup()
        replica._runner = runner
        try:
            site = web.TCPSite(runner, _HOST, 0)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        replica.url = f"http://{_HOST}:{runner.addresses[0][1]}"
        log.info("replica started name=%s url=%s", name, replica.url)
        return replica

    @property
    def running(self) -> bool:
        """Whether the port is still open."""
        return self._runner is not None

    def in_flight(self) -> int:
        """Sequences the engine holds now, running or waiting."""
        stats = self.sim.stats()
        return int(stats["running"] + stats["waiting"])

    async def stop(self) -> None:
        """Close the port, aborting whatever is still in flight (a pod's SIGKILL after its grace period)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            log.info("replica stopped name=%s", self.name)

    async def kill(self) -> None:
        """Die at once: every open connection is dropped mid-response, then the port is closed."""
        runner = self._runner
        if runner is None:
            return
        # Drop the connections before closing the port: nothing gets a graceful end, as with SIGKILL.
        for connection in runner.server.connections if runner.server else ():
            if connection.transport is not None:
                connection.transport.abort()
        await self.stop()


def replica_name(ordinal: int) -> str:
    """The pod-like name of the `ordinal`-th replica ever started."""
    return f"vllm-{ordinal}"


async def start_replicas(count: int, options: SimOptions) -> list[RestartableReplica]:
    """Start `count` replicas named vllm-0, vllm-1, ...; stops those started if one fails."""
    replicas: list[RestartableReplica] = []
    try:
        for ordinal in range(count):
            replicas.append(await RestartableReplica.start(replica_name(ordinal), options))
    except BaseException:
        for replica in replicas:
            await replica.stop()
        raise
    return replicas
