"""`kvgate bench inference-perf`: inference-perf's shared_prefix load through each router, run from a venv of its
own (Python >= 3.12), its per-request report read back as samples; skips when not installed.

Its config by hand: kvgate/loadtest/inference-perf-shared-prefix.yaml (a test keeps it equal to this one's)."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from kvgate.loadtest.cli import add_knobs, with_knobs
from kvgate.loadtest.kit.processes import ChildProcess, ProcessError
from kvgate.loadtest.kit.stream import RequestSample
from kvgate.loadtest.routing.client import OnSample
from kvgate.loadtest.routing.scenario import add_router_arguments, run_loads
from kvgate.loadtest.routing.workload import Footprint

# inference-perf's generated words average about six characters per token of a WordPiece tokenizer such as
# MiniLM's; the simulator counts four characters a token (measured: 773 simulated tokens for 500 requested).
SIM_TOKENS_PER_TOOL_TOKEN = 1.5
_LONGEST_REQUEST_MARGIN = 1.25  # head room over the estimated longest request, for lengths that vary
_GRACE_SECONDS = 240.0  # its start (torch, the tokenizer) takes a minute or more on a busy machine


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """inference-perf's shared_prefix data: groups of prompts behind one system prompt each, Poisson arrivals."""

    groups: int = 64
    prompts_per_group: int = 10
    system_prompt_tokens: int = 450
    question_tokens: int = 50
    output_tokens: int = 32
    rate: float = 10.0  # requests per second
    requests: int = 400
    seed: int = 0  # of the generated prompts and the arrival times
    model: str = "meta-llama/Llama-3.1-8B-Instruct"

    @property
    def duration(self) -> int:
        """Seconds of load: `requests` at `rate`."""
        return max(1, math.ceil(self.requests / self.rate))


QUICK_SHARED_PREFIX = SharedPrefixSpec(groups=8, prompts_per_group=5, system_prompt_tokens=200, question_tokens=30,
                                       output_tokens=8, rate=10.0, requests=40)


def inference_perf_config(spec: SharedPrefixSpec, base_url: str, tokenizer: str, report_dir: Path) -> dict[str, Any]:
    """An inference-perf config: streamed completions of shared_prefix prompts, Poisson at `spec.rate`, to `base_url`."""
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": spec.groups, "num_prompts_per_group": spec.prompts_per_group,
            "system_prompt_len": spec.system_prompt_tokens, "question_len": spec.question_tokens,
            "output_len": spec.output_tokens, "seed": spec.seed}},
        "load": {"type": "poisson", "stages": [{"rate": spec.rate, "duration": spec.duration}],
                 "base_seed": spec.seed},
        "server": {"type": "vllm", "model_name": spec.model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": tokenizer},
        "report": {"request_lifecycle": {
            "summary": True, "per_stage": False, "per_request": True,
            "per_request_fields": {"request": False, "response": False, "response_chunks": False}}},
        "storage": {"local_storage": {"path": str(report_dir)}},
    }  # fmt: skip


def samples_from_report(records: list[dict[str, Any]]) -> list[RequestSample]:
    """RequestSamples from inference-perf's per-request lifecycle report (times on its own clock)."""
    origin = min((record["start_time"] for record in records), default=0.0)
    samples = []
    for record in records:
        chunks = ((record.get("info") or {}).get("response_metrics") or {}).get("chunk_times") or []
        error = record.get("error")
        samples.append(RequestSample(start=record["start_time"] - origin,
                                     ttft=chunks[0] - record["start_time"] if chunks else None,
                                     e2e=record["end_time"] - record["start_time"], output_chunks=len(chunks),
                                     error=None if error is None else str(error)[:200]))
    return samples


async def run_inference_perf(executable: str, spec: SharedPrefixSpec, base_url: str, tokenizer: str,
                             work_dir: Path) -> list[RequestSample]:
    """Run inference-perf once against `base_url` (offline: HF_HUB_OFFLINE=1), bounded in time; its samples."""
    work_dir.mkdir(parents=True, exist_ok=True)
    report_dir, config_path, log_path = work_dir / "reports", work_dir / "config.yaml", work_dir / "inference-perf.log"
    config_path.write_text(yaml.safe_dump(inference_perf_config(spec, base_url, tokenizer, report_dir)))
    child = ChildProcess("inference-perf", [executable, "--config_file", str(config_path)], log_path, cwd=work_dir,
                         env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    await child.start()
    try:
        returncode = await child.wait(spec.duration + _GRACE_SECONDS)
    except TimeoutError:
        await child.stop(kill=True)
        raise ProcessError(f"inference-perf did not finish within {spec.duration + _GRACE_SECONDS:.0f}s") from None
    report = report_dir / "per_request_lifecycle_metrics.json"
    if returncode != 0 or not report.exists():
        raise ProcessError(f"inference-perf exited {returncode} without a report:\n{child.log_tail()}")
    return samples_from_report(orjson.loads(report.read_bytes()))


@dataclass(frozen=True, slots=True)
class SharedPrefixLoad:
    """inference-perf's shared_prefix data and load, as one routing benchmark load."""

    spec: SharedPrefixSpec
    executable: str
    tokenizer: str  # a tokenizer directory inference-perf loads offline
    name = "shared-prefix"
    skewed = False
    single_target = True

    @property
    def model(self) -> str:
        """The model the completions ask for."""
        return self.spec.model

    def describe(self) -> str:
        """Groups, prompt and output lengths, and arrivals."""
        spec = self.spec
        return (f"inference-perf shared_prefix: {spec.groups} groups x {spec.prompts_per_group} prompts, "
                f"{spec.system_prompt_tokens}-token system prompts, {spec.question_tokens}-token questions, "
                f"{spec.output_tokens} output tokens; {spec.requests} streamed completions, Poisson at {spec.rate:g} "
                f"req/s, seed {spec.seed} (tokens counted by inference-perf's tokenizer, {Path(self.tokenizer).name}).")

    def footprint(self, block_size: int, chars_per_token: float) -> Footprint:
        """Every group's system prompt and about a second's arrivals are in play at once."""
        spec = self.spec

        def blocks(tool_tokens: int) -> int:
            return math.ceil(tool_tokens * SIM_TOKENS_PER_TOOL_TOKEN / block_size)

        open_requests = max(1, math.ceil(spec.rate))
        system = spec.groups * blocks(spec.system_prompt_tokens)
        longest = (spec.system_prompt_tokens + spec.question_tokens) * SIM_TOKENS_PER_TOOL_TOKEN * _LONGEST_REQUEST_MARGIN
        return Footprint(in_play_blocks=system + open_requests * blocks(spec.question_tokens),
                         whole_blocks=system + spec.requests * blocks(spec.question_tokens + spec.output_tokens),
                         longest_request_tokens=math.ceil(longest) + spec.output_tokens, open_requests=open_requests)

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        """One inference-perf run against the row's one target."""
        (target,) = targets
        samples = await run_inference_perf(self.executable, self.spec, target, self.tokenizer, work_dir)
        for sample in samples:
            on_sample(sample)
        return samples


_SPEC_HELP = {
    "groups": "shared system prompts (num_groups)", "prompts_per_group": "prompts behind each",
    "system_prompt_tokens": "tokens of each system prompt", "question_tokens": "tokens of each question",
    "output_tokens": "output tokens per request", "rate": "Poisson arrivals, requests per second",
    "requests": "requests per row",
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The routers' flags, where inference-perf is, and the shared_prefix knobs."""
    add_router_arguments(parser, policies=("cache-aware",))
    parser.add_argument("--inference-perf", default="inference-perf", metavar="COMMAND",
                        help="the inference-perf command (Python >= 3.12: install it in a venv of its own)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="a tokenizer directory inference-perf loads offline (default: the kit's tiny model)")
    add_knobs(parser, SharedPrefixSpec(), _SPEC_HELP)


def run(options: argparse.Namespace) -> int:
    """Measure every row on the shared_prefix load; 0 with a message when inference-perf is not installed."""
    executable = shutil.which(options.inference_perf)
    if executable is None:
        print(f"kvgate bench inference-perf: skipped, {options.inference_perf!r} is not installed (pip install "
              "inference-perf into a Python >= 3.12 venv and pass --inference-perf VENV/bin/inference-perf)",
              file=sys.stderr)
        return 0
    tokenizer = options.tokenizer
    if tokenizer is None:
        from kvgate.loadtest.kit.tiny_model import write_tiny_model

        tokenizer = str(write_tiny_model(options.out / "tiny-model"))
    spec = with_knobs(options, QUICK_SHARED_PREFIX if options.quick else SharedPrefixSpec(), [*_SPEC_HELP, "seed"])
    load = SharedPrefixLoad(spec, executable, tokenizer)
    return run_loads(options, (load,), "inference-perf shared_prefix", "inference-perf")
