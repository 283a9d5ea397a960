"""The shared-prefix scenario, driven by the Gateway API Inference Extension's own tool, `inference-perf`.

inference-perf (PyPI `inference-perf`, Python >= 3.12) lives in a virtual environment of its own; the
benchmark writes its YAML config for each row, runs it against the row's router and reads back its
per-request report (start, first chunk, end, error), so its rows are summarised like every other.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from kvgate.loadtest.bench.client import RequestSample
from kvgate.loadtest.bench.processes import ProcessError

# inference-perf's generated words average about six characters per token of a WordPiece tokenizer such as
# MiniLM's; the simulator counts four characters a token (measured: 773 simulated tokens for 500 requested).
SIM_TOKENS_PER_TOOL_TOKEN = 1.5
_GRACE_SECONDS = 240.0  # its start (torch, the tokenizer) takes a minute or more on a busy machine
_LOG_TAIL_CHARS = 2000


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

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1, got {getattr(self, name)}" for name in
                    ("groups", "prompts_per_group", "system_prompt_tokens", "question_tokens", "output_tokens",
                     "requests") if getattr(self, name) < 1]
        if self.rate <= 0:
            problems.append(f"rate must be > 0, got {self.rate}")
        if problems:
            raise ValueError("invalid shared-prefix workload: " + "; ".join(problems))

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
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": spec.groups,
                "num_prompts_per_group": spec.prompts_per_group,
                "system_prompt_len": spec.system_prompt_tokens,
                "question_len": spec.question_tokens,
                "output_len": spec.output_tokens,
                "seed": spec.seed,
            },
        },
        "load": {"type": "poisson", "stages": [{"rate": spec.rate, "duration": spec.duration}],
                 "base_seed": spec.seed},
        "server": {"type": "vllm", "model_name": spec.model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": tokenizer},
        "report": {"request_lifecycle": {
            "summary": True, "per_stage": False, "per_request": True,
            "per_request_fields": {"request": False, "response": False, "response_chunks": False},
        }},
        "storage": {"local_storage": {"path": str(report_dir)}},
    }  # fmt: skip


def samples_from_report(records: list[dict[str, Any]]) -> list[RequestSample]:
    """RequestSamples from inference-perf's per-request lifecycle report (times on its own clock)."""
    if not records:
        return []
    origin = min(record["start_time"] for record in records)
    samples = []
    for record in records:
        chunks = ((record.get("info") or {}).get("response_metrics") or {}).get("chunk_times") or []
        error = record.get("error")
        samples.append(RequestSample(
            start=record["start_time"] - origin,
            ttft=chunks[0] - record["start_time"] if chunks else None,
            e2e=record["end_time"] - record["start_time"],
            output_chunks=len(chunks),
            error=None if error is None else str(error)[:200],
        ))
    return samples


async def run_inference_perf(
    executable: str, spec: SharedPrefixSpec, base_url: str, tokenizer: str, work_dir: Path
) -> list[RequestSample]:
    """Run inference-perf once against `base_url` (offline: HF_HUB_OFFLINE=1); its per-request samples."""
    work_dir.mkdir(parents=True, exist_ok=True)
    report_dir = work_dir / "reports"
    config_path = work_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(inference_perf_config(spec, base_url, tokenizer, report_dir)))
    log_path = work_dir / "inference-perf.log"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log_path.open("wb") as log_file:
        try:
            process = await asyncio.create_subprocess_exec(
                executable, "--config_file", str(config_path), stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=env, cwd=work_dir,
            )
        except OSError as exc:
            raise ProcessError(f"inference-perf could not start {executable!r}: {exc.strerror}") from None
        try:
            await asyncio.wait_for(process.wait(), spec.duration + _GRACE_SECONDS)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ProcessError(f"inference-perf did not finish within {spec.duration + _GRACE_SECONDS:.0f}s") from None
    report = report_dir / "per_request_lifecycle_metrics.json"
    if process.returncode != 0 or not report.exists():
        tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        raise ProcessError(f"inference-perf exited {process.returncode} without a report:\n{tail}")
    return samples_from_report(orjson.loads(report.read_bytes()))
