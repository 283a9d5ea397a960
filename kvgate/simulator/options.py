"""SimOptions: every knob of a simulated vLLM replica, and the CLI flags that set them."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field


def _knob(default: typing.Any, help_text: str) -> typing.Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True, slots=True)
class SimOptions:
    """How one simulated replica behaves; every replica of a fleet shares one."""

    models: tuple[str, ...] = _knob(
        ("meta-llama/Llama-3.1-8B-Instruct",), "served model names (the first is the model path and metrics label)"
    )
    lora_adapters: tuple[str, ...] = _knob((), "LoRA adapter names served on top of the first model")
    max_loras: int = _knob(1, "distinct LoRA adapters allowed in one running batch")
    max_model_len: int = _knob(8192, "context length: prompt plus output tokens")
    block_size: int = _knob(16, "tokens per KV cache block")
    num_gpu_blocks: int = _knob(2048, "KV cache capacity in blocks")
    enable_prefix_caching: bool = _knob(True, "keep full blocks cached for reuse by later requests")
    max_num_seqs: int = _knob(64, "sequences in the running batch at most; the rest wait")
    max_num_batched_tokens: int = _knob(8192, "tokens one engine step computes at most; longer prefills are chunked "
                                              "(vLLM's default on H100/H200; 2048 on other GPUs and on CPU)")
    prefill_seconds_per_token: float = _knob(0.0001, "prefill cost of each uncached prompt token")
    decode_step_seconds: float = _knob(0.015, "fixed cost of one engine step")
    decode_seconds_per_seq: float = _knob(0.0003, "added step cost per running sequence")
    default_max_tokens: int = _knob(16, "output tokens when a request sets no max_tokens")
    speed: float = _knob(1.0, "time compression: 10 runs every step ten times faster")
    priority_scheduling: bool = _knob(
        False, "order the waiting queue by request priority (vLLM --scheduling-policy priority)"
    )
    enable_prompt_tokens_details: bool = _knob(False, "report each request's cached prompt tokens in its usage "
                                                      "(usage.prompt_tokens_details, as vLLM's flag of that name)")
    legacy_cache_metric: bool = _knob(False, "also export vllm:gpu_cache_usage_perc like vLLM 0.10.x")
    startup_seconds: float = _knob(0.0, "model load time before /health and the API answer")
    tokenizer: str = _knob("", "model directory (tokenizer.json, tokenizer_config.json) to tokenize and render chats "
                               "with, as vLLM does; default: 4 characters per token and a built-in template")
    kv_events: bool = _knob(False, "publish KV-cache events over ZMQ as vLLM's --kv-events-config does, hashing "
                                   "blocks with sha256_cbor seeded by PYTHONHASHSEED (needs --tokenizer)")
    kv_events_port_offset: int = _knob(1000, "KV events publisher port = HTTP port + offset, replay port = HTTP "
                                             "port + 2 x offset (both ephemeral when the HTTP port is)")
    kv_events_topic: str = _knob("kv-events", "topic frame of every KV events message")
    kv_events_buffer: int = _knob(10_000, "event batches kept for replay (vLLM's buffer_steps)")

    def __post_init__(self) -> None:
        problems = []
        if not self.models:
            problems.append("models must name at least one model")
        overlap = set(self.models) & set(self.lora_adapters)
        if overlap:
            problems.append(f"lora_adapters reuse model names: {sorted(overlap)}")
        for name in (
            "max_loras",
            "max_model_len",
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "default_max_tokens",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_seconds_per_token", "decode_step_seconds", "decode_seconds_per_seq", "startup_seconds"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_events and not self.tokenizer:
            problems.append("kv_events needs a tokenizer directory: events carry real token ids")
        if self.kv_events_buffer < 1 or self.kv_events_port_offset < 1:
            problems.append("kv_events_buffer and kv_events_port_offset must be >= 1")
        if self.speed <= 0:
            problems.append(f"speed must be > 0, got {self.speed}")
        # vLLM refuses to start when one full-length sequence cannot fit in the KV cache.
        if self.max_model_len > self.num_gpu_blocks * self.block_size:
            problems.append(
                f"max_model_len {self.max_model_len} exceeds the KV cache capacity of "
                f"{self.num_gpu_blocks * self.block_size} tokens (num_gpu_blocks x block_size)"
            )
        if problems:
            raise ValueError("invalid simulator options: " + "; ".join(problems))

    def scaled(self, seconds: float) -> float:
        """Wall-clock seconds for a nominal duration under `speed`."""
        return seconds / self.speed


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one `--flag` per SimOptions field, defaulting to the dataclass defaults."""
    group = parser.add_argument_group("vLLM simulator")
    hints = typing.get_type_hints(SimOptions)
    for knob in dataclasses.fields(SimOptions):
        kind = hints[knob.name]
        help_text = knob.metadata["help"]
        if kind is bool:
            group.add_argument(
                _flag(knob.name), action=argparse.BooleanOptionalAction, default=knob.default, help=help_text
            )
        elif typing.get_origin(kind) is tuple:
            group.add_argument(_flag(knob.name), nargs="*", default=list(knob.default), metavar="NAME", help=help_text)
        else:
            group.add_argument(_flag(knob.name), type=kind, default=knob.default, help=help_text)


def sim_options_from_args(ns: argparse.Namespace) -> SimOptions:
    """Build SimOptions from a namespace parsed with `add_sim_arguments` flags."""
    values = {}
    for knob in dataclasses.fields(SimOptions):
        value = getattr(ns, knob.name)
        values[knob.name] = tuple(value) if isinstance(value, list) else value
    return SimOptions(**values)
