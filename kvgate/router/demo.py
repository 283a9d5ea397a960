"""`kvgate demo`: a simulated vLLM fleet on loopback with the gateway in front of it."""

from __future__ import annotations

import logging
import shlex

from kvgate.simulator import SimFleet, SimOptions
from kvgate.router.config import build_config
from kvgate.router.gateway import Gateway, default_discovery
from kvgate.router.server import GatewayServer

log = logging.getLogger(__name__)


def curl_example(base_url: str, model: str) -> str:
    """A curl command that streams a chat completion through the gateway."""
    body = f'{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Say hello"}}]}}'
    return f"curl -N {base_url}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"


async def run_demo(listen: str, replicas: int, policy: str) -> None:
    """Start `replicas` simulated replicas on free ports and the gateway on `listen`; serve until SIGTERM."""
    options = SimOptions()
    fleet = await SimFleet.start([0] * replicas, options)
    try:
        config = build_config({"listen": listen, "endpoints": fleet.urls, "policy": policy, "drain_delay": 0,
                               "max_connections": 1000})
        server = GatewayServer(config, Gateway(config, default_discovery(config)))
        await server.start()
        host, port = server.addresses[0]
        base = f"http://{host}:{port}"
        print(f"\nkvgate is up on {base} in front of {replicas} simulated vLLM replicas: {', '.join(fleet.urls)}",
              flush=True)
        print(f"Try it in another terminal:\n\n  {curl_example(base, options.models[0])}\n", flush=True)
        print(f"Fleet view: curl {base}/debug/fleet    Metrics: curl {base}/metrics    Stop: Ctrl-C\n", flush=True)
        await server.serve()
    finally:
        await fleet.stop()
