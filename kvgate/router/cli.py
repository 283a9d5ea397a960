"""`kvgate` command line: serve, sim, demo."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvgate.router.config import ConfigError, GatewayConfig, config_fields, from_sources, section_fields
from kvgate.router.logs import configure_logging

_HELP = {
    "listen": "HOST:PORT of the public listener",
    "admin_listen": "HOST:PORT serving /metrics and /debug/* (default: on the public listener)",
    "discovery": "static (--endpoints), kubernetes (EndpointSlices of --service) or inferencepool (Pods of --pool)",
    "picker_listen": "HOST:PORT serving the Gateway API endpoint picker (Envoy ext_proc, gRPC); off when unset",
    "picker_fallbacks": "endpoints listed after the chosen one for the data plane to retry on (0: just the one)",
    "pool": "InferencePool (inference.networking.k8s.io/v1) whose Pods are the replicas",
    "endpoints": "comma-separated replica base URLs for static discovery",
    "namespace": "namespace of the Service(s) or InferencePool to watch",
    "service": "Service whose EndpointSlices list the replicas (repeatable)",
    "port_name": "EndpointSlice port name to use",
    "port": "EndpointSlice port number to use",
    "policy": "routing policy: cache-aware, prefix-hash, least-load, round-robin",
    "connect_timeout": "seconds to connect to a replica",
    "idle_timeout": "longest silence in seconds between two upstream chunks",
    "request_timeout": "total seconds per request, 0 for none",
    "max_body_bytes": "largest accepted request body",
    "retries": "extra attempts on another replica when one fails before anything reached the client (connect "
               "failure, connection closed before answering, vLLM's shutdown answer)",
    "drain_delay": "seconds new requests are still taken after SIGTERM",
    "drain_timeout": "seconds in-flight requests get to finish after the listener closes",
    "scrape_interval": "seconds between /metrics scrapes of each replica",
    "scrape_timeout": "timeout in seconds of one /metrics scrape",
    "models_refresh": "seconds between /v1/models refreshes",
    "watch_read_timeout": "restart a Kubernetes watch silent this long (seconds)",
    "log_level": "debug, info, warning or error",
    "upstream_priority": "set vLLM's request priority from the class (replicas run --scheduling-policy priority)",
    "api_keys_file": "YAML file of API keys; requests then need Authorization: Bearer KEY",
    "max_connections": "open client connections per listener; past it new ones get a 503",
    "header_timeout": "seconds a client has to send a complete request head",
    "body_timeout": "longest silence in seconds while a request body arrives (then 408)",
    "keepalive_timeout": "seconds an idle client connection is kept open",
    "kv_events_endpoint": "replicas' KV events publishers: tcp://{host}:5557 ({host} = the replica's address) "
                          "or, repeated, REPLICA_URL=tcp://ADDR:PORT (or ipc://PATH); turns on precise routing",
    "kv_events_replay_endpoint": "replicas' KV events replay sockets, in the same forms (fills sequence gaps)",
    "kv_events_topic": "topic of the KV events messages",
    "kv_events_bind": "bind the explicit KV events addresses and let the engines connect (a vLLM --kv-events-config "
                      "endpoint without '*' connects out)",
    "kv_events_replay_timeout": "seconds to wait for one replayed batch",
    "kv_events_hold": "seconds a routed prompt's blocks count as held before the engine reports them",
    "kv_events_max_blocks": "bound on the precise index, in blocks, all replicas together",
    "peer_listen": "HOST:PORT publishing this gateway's routing decisions to its peers (ZMQ PUB); off when unset",
    "peers": "HOST:PORT of another gateway replica's --peer-listen, whose decisions this one learns (repeatable)",
    "peer_service": "Kubernetes Service (in --namespace) whose EndpointSlices list the gateway pods, port named "
                    "'peers': learn the decisions of every one of them",
    "tokenizer": "MODEL=DIR: tokenize MODEL's requests with DIR's tokenizer.json and chat template (repeatable)",
    "tokenize_offload_bytes": "prompts above this many bytes are tokenized off the event loop",
}
_REPEATABLE = ("service", "kv_events_endpoint", "kv_events_replay_endpoint", "tokenizer", "peers")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every GatewayConfig field as a flag (default None, so env and file values show through)."""
    parser.add_argument("--config", help="YAML file with the same settings in snake_case")
    for field in config_fields():
        action = "append" if field.name in _REPEATABLE else "store"
        parser.add_argument(_flag(field.name), dest=field.name, action=action, default=None,
                            help=f"{_HELP[field.name]} (env KVGATE_{field.name.upper()})")
    for section, field in section_fields():
        parser.add_argument(f"--{section}-" + field.name.replace("_", "-"), dest=f"{section}.{field.name}",
                            default=None, help=f"{section}.{field.name} (env KVGATE_{section.upper()}_{field.name.upper()})")


def cli_settings(namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, nested the way the config file nests them."""
    settings: dict[str, Any] = {}
    for key, value in vars(namespace).items():
        if key in ("command", "func") or value is None:
            continue
        section, dot, name = key.partition(".")
        if dot:
            settings.setdefault(section, {})[name] = value
        else:
            settings[key] = value
    return settings


async def serve_gateway(config: GatewayConfig) -> None:
    """Run one gateway until SIGTERM, then drain."""
    from kvgate.router.gateway import Gateway, default_discovery
    from kvgate.router.server import GatewayServer

    server = GatewayServer(config, Gateway(config, default_discovery(config)))
    await server.start()
    await server.serve()


def _cmd_serve(ns: argparse.Namespace) -> int:
    config = from_sources(cli_settings(ns))
    configure_logging(config.log_level)
    _run(serve_gateway(config))
    return 0


def _cmd_sim(ns: argparse.Namespace) -> int:
    from kvgate.simulator import serve_fleet, sim_options_from_args

    ports = [int(p) for p in ns.ports.split(",") if p.strip()]
    try:
        options = sim_options_from_args(ns)
    except ValueError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    configure_logging("info")
    _run(serve_fleet(ports, options, ns.host))
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    from kvgate.router.demo import run_demo

    configure_logging(ns.log_level)
    _run(run_demo(ns.listen, ns.replicas, ns.policy))
    return 0


def _run(main: Any) -> None:
    """Run a coroutine on uvloop."""
    import uvloop

    uvloop.run(main)


def build_parser() -> argparse.ArgumentParser:
    """The `kvgate` argument parser."""
    parser = argparse.ArgumentParser(prog="kvgate", description="Cache-aware inference gateway for vLLM fleets")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gateway")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    from kvgate.simulator import add_sim_arguments

    sim = commands.add_parser("sim", help="run simulated vLLM replicas on loopback")
    sim.add_argument("--ports", required=True, help="comma-separated ports, one replica each")
    sim.add_argument("--host", default="127.0.0.1")
    add_sim_arguments(sim)
    sim.set_defaults(func=_cmd_sim)

    demo = commands.add_parser("demo", help="a simulated 3-replica fleet with the gateway in front")
    demo.add_argument("--listen", default="127.0.0.1:8080")
    demo.add_argument("--replicas", type=int, default=3)
    demo.add_argument("--policy", default="cache-aware")
    demo.add_argument("--log-level", default="info")
    demo.set_defaults(func=_cmd_demo)

    bench = commands.add_parser("bench", add_help=False,
                                help="run a benchmark scenario (routing, overhead, priority, soak, ...); "
                                     "`kvgate bench --help` lists them")
    bench.set_defaults(func=None)  # main() hands `kvgate bench ...` to the benchmark kit before parsing
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvgate` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["bench"]:
        try:  # the kit is for development: the image leaves it out
            from kvgate.loadtest.cli import main as bench_main
        except ModuleNotFoundError:
            print("kvgate: `kvgate bench` needs the benchmark kit (kvgate/loadtest), not installed here", file=sys.stderr)
            return 2
        return bench_main(args[1:])
    ns = build_parser().parse_args(args)
    try:
        return ns.func(ns)
    except ConfigError as exc:
        print(f"kvgate: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
