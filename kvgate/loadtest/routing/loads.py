"""What a routing benchmark sends: a load is sized by its own parameters and driven through each row's router."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvgate.loadtest.kit.stream import RequestSample
from kvgate.loadtest.routing.client import ConversationDriver, OnSample
from kvgate.loadtest.routing.sizing import Footprint
from kvgate.loadtest.routing.workload import WorkloadSpec, build_conversations


class Load(Protocol):
    """One workload every row of a routing benchmark is measured on."""

    name: str  # in the report
    model: str  # the model its requests ask for
    skewed: bool  # popularity is skewed: the balance targets apply
    single_target: bool  # its load generator takes one base URL: several gateways then need a front

    def describe(self) -> str:
        """One sentence on what it sends."""

    def footprint(self, block_size: int, chars_per_token: float) -> Footprint:
        """How much KV cache its prefixes take."""

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        """Send the load to `targets`; the samples of every request."""


@dataclass(frozen=True, slots=True)
class ChatLoad:
    """Multi-turn chats of tenants sharing system prompts, sent by the benchmark's own client."""

    name: str
    spec: WorkloadSpec
    single_target = False

    @property
    def model(self) -> str:
        """The workload's model."""
        return self.spec.model

    @property
    def skewed(self) -> bool:
        """Zipf popularity is skewed."""
        return self.spec.skew == "zipf"

    def describe(self) -> str:
        """Tenants, prompts, conversations, and how they arrive."""
        spec = self.spec
        popularity = f"Zipf-skewed popularity (s={spec.zipf_s})" if self.skewed else "uniform popularity"
        arrivals = (f"Poisson arrivals at {spec.rate:g} req/s, {spec.concurrency} conversations open at once"
                    if spec.rate else f"{spec.concurrency} concurrent users")
        return (f"{spec.tenants} tenants, {popularity}, each with a {spec.system_prompt_chars}-character system "
                f"prompt; {spec.conversations} conversations of {spec.turns} streamed turns (~{spec.user_chars} "
                f"characters each, max_tokens {spec.max_tokens}), {arrivals}, seed {spec.seed}, capped at "
                f"{spec.duration:.0f} s per row.")

    def footprint(self, block_size: int, chars_per_token: float) -> Footprint:
        """Every tenant's system prompt and every open conversation."""
        return Footprint.of_chats(self.spec, block_size, chars_per_token)

    async def drive(self, targets: Sequence[str], work_dir: Path, on_sample: OnSample) -> list[RequestSample]:
        """The conversations, through `targets` in turn."""
        return await ConversationDriver(self.spec, targets, on_sample).run(build_conversations(self.spec))
