"""The benchmark's scenarios: what each sends, how much KV cache its prefixes take, and how it is described.

Every scenario is sized by its own parameters, never by one seed's outcome: multi-turn chats (uniform or
Zipf tenant popularity, Poisson arrivals, driven by the benchmark's own client) and inference-perf's
shared_prefix data (driven by inference-perf itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from kvgate.loadtest.bench.client import PoissonChatDriver, RequestSample
from kvgate.loadtest.bench.inference_perf import SIM_TOKENS_PER_TOOL_TOKEN, SharedPrefixSpec, run_inference_perf
from kvgate.loadtest.bench.sizing import Footprint
from kvgate.loadtest.bench.workload import PrefixFootprint, WorkloadSpec, build_conversations

OnSample = Callable[[RequestSample], None]
# Head room over the estimated longest request, for generated lengths that vary.
_LONGEST_REQUEST_MARGIN = 1.25


class Scenario(Protocol):
    """One workload the benchmark runs every row on."""

    name: str
    skewed: bool  # whether popularity is skewed: the balance targets apply
    single_target: bool  # whether its load generator takes one base URL (several gateways need a front)
    model: str

    def describe(self) -> str:
        """One sentence on what the scenario sends."""
        ...

    def parameters(self) -> dict[str, Any]:
        """Its parameters, for the report."""
        ...

    def footprint(self, block_size: int) -> Footprint:
        """How much KV cache its prefixes take."""
        ...

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        """Send the scenario's load to `targets`; the samples of every request."""
        ...


@dataclass(frozen=True, slots=True)
class ChatScenario:
    """Multi-turn chats of tenants sharing system prompts, Poisson arrivals, by the benchmark's own client."""

    name: str
    spec: WorkloadSpec
    single_target = False

    @property
    def skewed(self) -> bool:
        return self.spec.skew == "zipf"

    @property
    def model(self) -> str:
        return self.spec.model

    def describe(self) -> str:
        spec = self.spec
        popularity = f"Zipf tenant popularity (s={spec.zipf_s})" if self.skewed else "uniform tenant popularity"
        return (
            f"{spec.tenants} tenants with ~{spec.system_prompt_chars // 4}-token system prompts "
            f"({spec.system_prompt_chars} characters), {popularity}; {spec.conversations} conversations of "
            f"{spec.turns} streamed turns (~{spec.user_chars} characters each, max_tokens {spec.max_tokens}), "
            f"{spec.concurrency} open at once; Poisson arrivals at {spec.rate:g} req/s, seed {spec.seed}, "
            f"capped at {spec.duration:.0f} s per row."
        )

    def parameters(self) -> dict[str, Any]:
        return asdict(self.spec)

    def footprint(self, block_size: int) -> Footprint:
        spec, prefix = self.spec, PrefixFootprint.of(self.spec, block_size)
        return Footprint(
            in_play_blocks=prefix.all_system_prompts(spec) + spec.concurrency * prefix.history_blocks,
            whole_blocks=prefix.whole_workload(spec),
            longest_request_tokens=prefix.longest_request_tokens,
            open_requests=spec.concurrency,
        )

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        return await PoissonChatDriver(self.spec, targets, on_sample).run(build_conversations(self.spec))


@dataclass(frozen=True, slots=True)
class SharedPrefixScenario:
    """inference-perf's shared_prefix data generator and load, run from its own virtual environment."""

    name: str
    spec: SharedPrefixSpec
    executable: str  # the inference-perf command
    tokenizer: str  # a tokenizer directory inference-perf loads offline
    skewed = False
    single_target = True

    @property
    def model(self) -> str:
        return self.spec.model

    def describe(self) -> str:
        spec = self.spec
        return (
            f"inference-perf shared_prefix: {spec.groups} groups x {spec.prompts_per_group} prompts, "
            f"{spec.system_prompt_tokens}-token system prompts, {spec.question_tokens}-token questions, "
            f"{spec.output_tokens} output tokens; {spec.requests} streamed completions, Poisson at {spec.rate:g} "
            f"req/s (tokens counted by inference-perf's tokenizer, {self.tokenizer.rstrip('/').rsplit('/', 2)[-2]})."
        )

    def parameters(self) -> dict[str, Any]:
        return asdict(self.spec) | {"executable": self.executable, "tokenizer": self.tokenizer}

    def footprint(self, block_size: int) -> Footprint:
        spec = self.spec

        def blocks(tool_tokens: int) -> int:
            return math.ceil(tool_tokens * SIM_TOKENS_PER_TOOL_TOKEN / block_size)

        open_requests = max(1, math.ceil(spec.rate))  # about a second's arrivals are open at once
        system = spec.groups * blocks(spec.system_prompt_tokens)
        return Footprint(
            in_play_blocks=system + open_requests * blocks(spec.question_tokens),
            whole_blocks=system + spec.requests * blocks(spec.question_tokens + spec.output_tokens),
            longest_request_tokens=math.ceil(
                (spec.system_prompt_tokens + spec.question_tokens) * SIM_TOKENS_PER_TOOL_TOKEN
                * _LONGEST_REQUEST_MARGIN) + spec.output_tokens,
            open_requests=open_requests,
        )

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        (target,) = targets
        samples = await run_inference_perf(self.executable, self.spec, target, self.tokenizer, work_dir)
        for sample in samples:
            on_sample(sample)
        return samples
