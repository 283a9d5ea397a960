"""What a load run asks for and what it measured, shared by both load generators."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadSpec:
    """One load run against one base URL: closed loop at `concurrency`, or open loop at `rate` req/s."""

    url: str
    body_bytes: int = 4096
    stream: bool = False
    chunks: int = 16  # SSE events per streamed answer
    chunk_interval_ms: float = 0.0
    concurrency: int = 32
    rate: float = 0.0  # > 0: open loop, requests sent on schedule whatever the answers do
    duration_s: float = 5.0
    max_requests: int = 0  # > 0: stop after this many measured requests
    warmup_s: float = 0.5  # requests started in this first stretch are not measured
    variants: int = 256  # distinct bodies cycled through
    watch: tuple[tuple[str, int], ...] = ()  # (name, pid) of processes whose CPU to charge over the measured stretch

    def headers(self) -> dict[str, str]:
        """Request headers, including the stub's streaming knobs (which kvgate forwards unchanged)."""
        return {"Content-Type": "application/json", "x-bench-chunks": str(self.chunks),
                "x-bench-chunk-interval-ms": str(self.chunk_interval_ms)}

    def to_json(self) -> dict:
        """The spec as plain JSON."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LoadResult:
    """Throughput, latency and failures of one run, as seen by the client."""

    generator: str
    requests: int
    errors: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    first_error: str = ""
    busy: dict[str, float] = field(default_factory=dict)  # CPU seconds per wall second, by process name

    @property
    def rps(self) -> float:
        """Completed requests per second over the measured stretch."""
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> dict:
        """The result as plain JSON, with the derived rate."""
        return {**dataclasses.asdict(self), "rps": round(self.rps, 1)}

    @classmethod
    def from_json(cls, data: dict) -> LoadResult:
        """Rebuild a result from `to_json` output."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})
