"""The routing benchmarks' traffic (tenants with long shared system prompts, multi-turn chats; seeded, so every
row and the locustfile send the same text) and the fleet sizing it implies. Light: the locustfile imports it."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.simulator import SimOptions

SKEWS = ("uniform", "zipf")

_WORDS = (
    "account", "answer", "archive", "balance", "billing", "branch", "budget", "calendar", "catalog", "channel",
    "contract", "customer", "dashboard", "delivery", "deploy", "detail", "device", "document", "estimate",
    "feature", "invoice", "ledger", "license", "meeting", "message", "network", "order", "payment", "policy",
    "portal", "product", "project", "quote", "record", "refund", "region", "report", "request", "review",
    "schedule", "service", "shipment", "status", "summary", "support", "ticket", "update", "warranty",
)  # fmt: skip
# The sim's chat template adds about this many characters around each message.
_TEMPLATE_CHARS_PER_MESSAGE = 60
# Generated words with their leading space: about 6.5 characters on average, 10 at the longest.
_MEAN_REPLY_CHARS_PER_TOKEN = 6.5
_MAX_REPLY_CHARS_PER_TOKEN = 10
CHARS_PER_TOKEN = 4  # the simulator's own tokenization
REAL_TOKENIZER_CHARS_PER_TOKEN = 3.0  # a conservative figure for a real (byte-level BPE) tokenizer


def _words(rng: random.Random, chars: int) -> str:
    """Random vocabulary words joined by spaces, cut to exactly `chars` characters."""
    pieces: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(_WORDS)
        pieces.append(word)
        length += len(word) + 1
    return " ".join(pieces)[:chars]


def system_prompt(tenant: int, chars: int) -> str:
    """The shared system prompt of one tenant: the same text for a tenant on every call; none when `chars` is 0."""
    if not chars:
        return ""
    opening = f"You are the support assistant of tenant {tenant:04d}. Follow the handbook below.\n"
    return opening + _words(random.Random(f"tenant-{tenant}"), max(0, chars - len(opening)))


def user_message(conversation: int, turn: int, chars: int, seed: int = 0) -> str:
    """The user's message at `turn` of a conversation, around `chars` characters (0.5x to 1.5x)."""
    rng = random.Random(f"user-{seed}-{conversation}-{turn}")
    length = rng.randint(max(1, chars // 2), max(1, chars * 3 // 2))
    return f"Question {turn + 1}: " + _words(rng, length)


def tenant_weights(tenants: int, skew: str, zipf_s: float) -> list[float]:
    """Relative popularity of each tenant: equal, or Zipf (rank ** -s) with tenant 0 the most popular."""
    if skew == "uniform":
        return [1.0] * tenants
    if skew == "zipf":
        return [(rank + 1) ** -zipf_s for rank in range(tenants)]
    raise ValueError(f"unknown skew {skew!r}; expected one of {', '.join(SKEWS)}")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The size and shape of one benchmark workload."""

    tenants: int = 12
    system_prompt_chars: int = 6000
    conversations: int = 100
    turns: int = 4
    user_chars: int = 300
    max_tokens: int = 32
    concurrency: int = 24  # users back to back, or with a rate the conversations open at once
    rate: float = 0.0  # > 0: Poisson arrivals, requests per second, instead of users back to back
    duration: float = 45.0  # time cap per row, seconds
    skew: str = "uniform"
    zipf_s: float = 1.1
    seed: int = 0
    model: str = "meta-llama/Llama-3.1-8B-Instruct"

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be >= 1, got {getattr(self, name)}"
            for name in ("tenants", "conversations", "turns", "user_chars", "max_tokens", "concurrency")
            if getattr(self, name) < 1
        ]
        if self.system_prompt_chars and self.system_prompt_chars < 100:
            problems.append(f"system_prompt_chars must be 0 (no system prompt) or >= 100, got {self.system_prompt_chars}")
        if self.duration <= 0:
            problems.append(f"duration must be > 0, got {self.duration}")
        if self.rate < 0:
            problems.append(f"rate must be >= 0, got {self.rate}")
        if self.skew not in SKEWS:
            problems.append(f"skew must be one of {', '.join(SKEWS)}, got {self.skew!r}")
        if problems:
            raise ValueError("invalid workload: " + "; ".join(problems))

    def with_skew(self, skew: str) -> WorkloadSpec:
        """The same workload with another tenant popularity."""
        return replace(self, skew=skew)


DEFAULT_WORKLOAD = WorkloadSpec()
QUICK_WORKLOAD = WorkloadSpec(
    tenants=6, system_prompt_chars=3000, conversations=24, turns=3, user_chars=200, max_tokens=8,
    concurrency=6, duration=10.0,
)  # fmt: skip
# The chats scenario: Poisson arrivals; under Zipf popularity a few popular tenants bring a higher rate, and open
# conversations grow with it (1.2 per req/s), else arrivals find every conversation waiting for its answer.
CHAT_UNIFORM = WorkloadSpec(tenants=24, system_prompt_chars=6400, conversations=240, turns=6, rate=20.0,
                            duration=120.0, zipf_s=1.2)
CHAT_ZIPF = replace(CHAT_UNIFORM, skew="zipf", rate=45.0, concurrency=54)
QUICK_CHATS = replace(QUICK_WORKLOAD, rate=12.0)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One scripted chat: a tenant's system prompt (or none: "") and the user's message for each turn."""

    index: int
    tenant: int
    system_prompt: str
    user_turns: tuple[str, ...]


def build_conversations(spec: WorkloadSpec) -> list[Conversation]:
    """The conversations of a workload; tenants drawn by popularity from a seeded generator."""
    rng = random.Random(f"tenants-{spec.seed}-{spec.skew}")
    weights = tenant_weights(spec.tenants, spec.skew, spec.zipf_s)
    tenants = rng.choices(range(spec.tenants), weights=weights, k=spec.conversations)
    prompts = {tenant: system_prompt(tenant, spec.system_prompt_chars) for tenant in set(tenants)}
    return [
        Conversation(
            index=index,
            tenant=tenant,
            system_prompt=prompts[tenant],
            user_turns=tuple(user_message(index, turn, spec.user_chars, spec.seed) for turn in range(spec.turns)),
        )
        for index, tenant in enumerate(tenants)
    ]


@dataclass(frozen=True, slots=True)
class PrefixFootprint:
    """KV blocks a workload's prefixes take: a tenant's shared system prompt and one conversation's turns."""

    system_prompt_blocks: int  # one tenant's system prompt
    history_blocks: int  # one conversation's turns, replies included, at typical lengths
    longest_history_blocks: int  # the same at the longest lengths the workload allows
    longest_request_tokens: int  # prompt plus output of the longest possible last turn

    @classmethod
    def of(cls, spec: WorkloadSpec, block_size: int, chars_per_token: float = CHARS_PER_TOKEN) -> PrefixFootprint:
        """Estimates from the workload's sizes at `chars_per_token` (the simulator's own: four)."""
        template = 2 * _TEMPLATE_CHARS_PER_MESSAGE
        system_chars = spec.system_prompt_chars + template if spec.system_prompt_chars else 0
        typical_turn = spec.user_chars + spec.max_tokens * _MEAN_REPLY_CHARS_PER_TOKEN + template
        longest_turn = spec.user_chars * 3 // 2 + spec.max_tokens * _MAX_REPLY_CHARS_PER_TOKEN + template

        def blocks(chars: float) -> int:
            return math.ceil(chars / chars_per_token / block_size)

        return cls(blocks(system_chars), blocks(round(spec.turns * typical_turn)), blocks(spec.turns * longest_turn),
                   math.ceil((system_chars + spec.turns * longest_turn) / chars_per_token) + spec.max_tokens)

    def all_system_prompts(self, spec: WorkloadSpec) -> int:
        """Blocks of every tenant's system prompt together."""
        return spec.tenants * self.system_prompt_blocks

    def whole_workload(self, spec: WorkloadSpec) -> int:
        """Blocks that hold every prefix the workload ever sends: an effectively unbounded cache."""
        return self.all_system_prompts(spec) + spec.conversations * self.longest_history_blocks


@dataclass(frozen=True, slots=True)
class Footprint:
    """KV cache a load's prefixes take, in blocks of the fleet's block size."""

    in_play_blocks: int  # distinct prefixes live at once: what a replica holding `cache_fraction` of is sized by
    whole_blocks: int  # every prefix the load ever sends: the oracle never evicts
    longest_request_tokens: int  # prompt plus output of the longest request
    open_requests: int  # requests the load keeps open at once, about

    @classmethod
    def of_chats(cls, spec: WorkloadSpec, block_size: int, chars_per_token: float = CHARS_PER_TOKEN) -> Footprint:
        """Every tenant's system prompt and every open conversation are in play at once."""
        prefix = PrefixFootprint.of(spec, block_size, chars_per_token)
        return cls(prefix.all_system_prompts(spec) + spec.concurrency * prefix.history_blocks,
                   prefix.whole_workload(spec), prefix.longest_request_tokens, spec.concurrency)


    def model_len(self, block_size: int) -> int:
        """A context length that fits the longest request, in whole blocks."""
        return math.ceil(self.longest_request_tokens / block_size) * block_size


def fleet_options(footprint: Footprint, model: str, base: SimOptions, cache_fraction: float,
                  tokenizer_dir: Path | None = None) -> SimOptions:
    """Replica settings whose KV cache holds `cache_fraction` of the distinct prefixes in play (at one half, a
    router that keeps each tenant and conversation on one of three replicas finds its prefixes cached, while one
    that spreads every tenant everywhere keeps evicting them); with `tokenizer_dir`, publishing KV events."""
    model_len = footprint.model_len(base.block_size)
    blocks = max(math.ceil(cache_fraction * footprint.in_play_blocks), model_len // base.block_size)
    options = dataclasses.replace(base, models=(model,), num_gpu_blocks=blocks, max_model_len=model_len,
                                  max_num_seqs=max(base.max_num_seqs, footprint.open_requests))
    if tokenizer_dir is None:
        return options
    return dataclasses.replace(options, tokenizer=str(tokenizer_dir), kv_events=True)


def oracle_options(footprint: Footprint, model: str, base: SimOptions, tokenizer_dir: Path | None = None) -> SimOptions:
    """One replica that never evicts a prefix (twice the bound) and never queues for a seat: the hit-rate ceiling."""
    options = dataclasses.replace(base, models=(model,), num_gpu_blocks=2 * footprint.whole_blocks,
                                  max_model_len=footprint.model_len(base.block_size),
                                  max_num_seqs=2 * footprint.open_requests)
    return options if tokenizer_dir is None else dataclasses.replace(options, tokenizer=str(tokenizer_dir))


def pressure_oracle_options(fleet: SimOptions, replicas: int) -> SimOptions:
    """One replica whose cache and seats equal the whole fleet's: what routing under pressure could at best hit."""
    return dataclasses.replace(fleet, num_gpu_blocks=replicas * fleet.num_gpu_blocks, kv_events=False,
                               max_num_seqs=replicas * fleet.max_num_seqs)
