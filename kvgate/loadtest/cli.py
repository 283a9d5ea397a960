"""`kvgate bench SCENARIO [options]`: every benchmark of kvgate, each a scenario of one harness; a scenario module
has `add_arguments(parser)` and `run(options) -> int` and is imported only when chosen."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvgate.loadtest.kit.processes import ProcessError
from kvgate.loadtest.kit.report import BadOption, code_version, describe_code

_Preset = TypeVar("_Preset")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One benchmark: its module, what it measures in a line, and which common options it takes."""

    name: str
    module: str
    summary: str
    common: tuple[str, ...] = ()  # of "seed", "duration", "runs"


SCENARIOS = (
    Scenario("routing", "kvgate.loadtest.routing.scenario", "routing policies (and --external routers) on a "
             "simulated fleet, closed-loop chats: hit rate, TTFT, balance against an oracle", ("seed", "duration", "runs")),
    Scenario("chats", "kvgate.loadtest.routing.chats", "Poisson multi-turn chats of tenants with shared system "
             "prompts, uniform and Zipf popularity, against a peer router", ("seed", "duration", "runs")),
    Scenario("inference-perf", "kvgate.loadtest.routing.inference_perf", "inference-perf's shared_prefix load "
             "through each router (skips unless inference-perf is installed)", ("seed", "runs")),
    Scenario("real-engines", "kvgate.loadtest.routing.real_engines", "the routing rows on real vLLM engines (CPU "
             "build), hit rates from vLLM's own counters", ("seed", "duration", "runs")),
    Scenario("overhead", "kvgate.loadtest.overhead.scenario", "kvgate's own cost: direct to instant stubs vs through "
             "kvgate, CPU per streamed chunk, py-spy profile", ("duration",)),
    Scenario("priority", "kvgate.loadtest.priority.scenario", "interactive and batch classes at twice the fleet's "
             "capacity, with and without admission control", ("seed", "duration")),
    Scenario("burst", "kvgate.loadtest.priority.burst", "many streams opened at once on an idle fleet with room to "
             "spare, through kvgate and --external routers: time to first token"),
    Scenario("soak", "kvgate.loadtest.soak.scenario", "minutes of streaming load with faults and replica kills: "
             "memory, descriptors, lost requests", ("seed", "duration")),
    Scenario("rolling", "kvgate.loadtest.rolling.scenario", "a rolling restart of the fleet under streaming load: "
             "failed requests and TTFT before, during and after", ("duration",)),
    Scenario("picker", "kvgate.loadtest.picker", "kvgate as Envoy's endpoint picker beside kvgate as a proxy: "
             "hit rate, TTFB and CPU per request and chunk", ("seed", "duration")),
    Scenario("hashing", "kvgate.loadtest.hashing", "cost of building RequestInfo (prefix hashing, engine "
             "tokenization) and of one pick, against parsing the body"),
    Scenario("scrape-parse", "kvgate.loadtest.scrape_parse", "cost of kvgate's parse of a vLLM /metrics page "
             "against prometheus_client's"),
)
_COMMON_HELP = {
    "seed": (int, "seed of the generated load (the same seed replays the same requests)"),
    "duration": (float, "seconds of load per measured run (the scenario's preset when not given)"),
    "runs": (int, "measured runs of each row; the tables show the median and the range over them"),
}


def add_knobs(parser: argparse.ArgumentParser, preset: object, helps: dict[str, str], title: str | None = None) -> None:
    """A flag per field of the dataclass `preset` named in `helps` (in a group `title`), overriding its value."""
    group = parser.add_argument_group(title) if title else parser
    for name, text in helps.items():
        value = getattr(preset, name)
        group.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                           help=f"{text} (default {value})")


def with_knobs(options: argparse.Namespace, preset: _Preset, names: Iterable[str] | Mapping[str, str]) -> _Preset:
    """The dataclass `preset` with the values of the flags among `names` that were given (a mapping: field -> flag)."""
    flags = names if isinstance(names, Mapping) else {name: name for name in names}
    return dataclasses.replace(preset, **{field: getattr(options, flag) for field, flag in flags.items()
                                          if getattr(options, flag, None) is not None})


def _external_router(value: str) -> tuple[str, str]:
    name, sep, template = value.partition("=")
    if not sep or not name.strip() or not template.strip():
        raise argparse.ArgumentTypeError("expected NAME=COMMAND TEMPLATE")
    return name.strip(), template.strip()


def add_external_argument(parser: argparse.ArgumentParser) -> None:
    """--external NAME=TEMPLATE (repeatable): another router to measure beside kvgate."""
    parser.add_argument("--external", type=_external_router, action="append", default=[], metavar="NAME=TEMPLATE",
                        help="another router's command line (nginx, SGLang's router, ...); {workers} becomes the "
                             "replica URLs separated by spaces, {port} its listen port (repeatable)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="scenarios:\n" + "\n".join(f"  {s.name:<15} {s.summary}" for s in SCENARIOS))
    parser.add_argument("scenario", choices=[s.name for s in SCENARIOS], metavar="SCENARIO",
                        help="the benchmark to run (listed below); `kvgate bench SCENARIO --help` for its options")
    return parser


def scenario_parser(scenario: Scenario) -> argparse.ArgumentParser:
    """The command line of one scenario: the common options it takes, then its own."""
    parser = argparse.ArgumentParser(prog=f"kvgate bench {scenario.name}", description=scenario.summary)
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the JSON and Markdown report")
    parser.add_argument("--docs", type=Path, metavar="FILE",
                        help="also write the results into this Markdown file's section (docs/benchmarks.md)")
    parser.add_argument("--quick", action="store_true", help="a tiny run of seconds (what the tests run)")
    for name in scenario.common:
        kind, text = _COMMON_HELP[name]
        parser.add_argument(f"--{name}", type=kind, default=1 if name == "runs" else None, help=text)
    importlib.import_module(scenario.module).add_arguments(parser)
    return parser


def command_line(argv: Sequence[str]) -> str:
    """The command that repeats a run, for its report: `kvgate bench` and its arguments, not where outputs went."""
    shown: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--docs"):
            skip = True
        elif not arg.startswith(("--out=", "--docs=")):
            shown.append(arg)
    return shlex.join(["kvgate", "bench", *shown])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `kvgate bench`."""
    args = list(sys.argv[1:] if argv is None else argv)
    chosen = {s.name: s for s in SCENARIOS}.get(args[0]) if args else None
    if chosen is None:
        _parser().parse_args(args)  # --help lists the scenarios; anything else is a usage error
        return 2
    options = scenario_parser(chosen).parse_args(args[1:])
    if getattr(options, "runs", 1) < 1:
        print("kvgate bench: --runs must be >= 1", file=sys.stderr)
        return 2
    options.command = command_line(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    print(f"kvgate bench {chosen.name}: {describe_code(code_version())}", file=sys.stderr)
    try:
        return importlib.import_module(chosen.module).run(options)
    except BadOption as exc:
        print(f"kvgate bench {chosen.name}: {exc}", file=sys.stderr)
        return 2
    except ProcessError as exc:
        print(f"kvgate bench {chosen.name}: {exc}", file=sys.stderr)
        return 1
