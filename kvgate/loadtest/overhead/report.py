"""The overhead report's Markdown, rendered from its JSON record."""

from __future__ import annotations

from typing import Any


def _comparison_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| load | generator | direct req/s | via kvgate req/s | ratio | direct p50 ms | added p50 ms "
             "| direct p99 ms | added p99 ms | errors | kvgate CPU busy | bound by |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        direct, kvgate = row["direct"], row["kvgate"]
        lines.append(
            f"| {row['name']} | {kvgate['generator']} | {direct['rps']:.0f} | {kvgate['rps']:.0f} "
            f"| {row['rps_ratio']:.2f} | {direct['p50_ms']:.2f} | {row['added_p50_ms']:+.2f} "
            f"| {direct['p99_ms']:.2f} | {row['added_p99_ms']:+.2f} | {direct['errors'] + kvgate['errors']} "
            f"| {kvgate['busy']['kvgate']:.0%} | {row['bound']} |")
    return lines


def _stream_cpu_table(cpu: dict[str, Any]) -> list[str]:
    ratio = "n/a" if cpu["kvgate_over_stub"] is None else f"{cpu['kvgate_over_stub']:.2f}"
    return ["| streamed chunks | wall s | kvgate CPU s / 10k chunks | stub CPU s / 10k chunks | kvgate / stub |",
            "|---|---|---|---|---|",
            f"| {cpu['chunks']} | {cpu['wall_s']:.1f} | {cpu['kvgate_cpu_s_per_10k_chunks']:.3f} "
            f"| {cpu['stub_cpu_s_per_10k_chunks']:.3f} | {ratio} |"]


def _profile_lines(profiles: dict[str, Any]) -> list[str]:
    lines = []
    for load, profile in profiles.items():
        if profile is None:
            lines.append(f"- {load}: no profile (py-spy missing or not permitted)")
            continue
        own = ", ".join(f"`{frame}` {share:.0%}" for frame, share in profile["top_self"][:6])
        ours = ", ".join(f"`{frame}` {share:.0%}" for frame, share in profile["top_by_kvgate_caller"][:6])
        lines.append(f"- {load} ({profile['samples']} busy samples). Self time: {own}.")
        lines.append(f"  By the deepest kvgate function on the stack (the library work it calls included): {ours}.")
    return lines


def limits_sentence(report: dict[str, Any]) -> str:
    """Which process bounded the closed-loop runs through kvgate, in one sentence."""
    bounds = [row["bound"] for row in report["rows"] if row["spec"]["rate"] == 0 and row["spec"]["concurrency"] > 1]
    by_kvgate = bounds.count("kvgate CPU")
    generator = report["meta"]["closed_loop_generator"]
    return (f"{by_kvgate} of {len(bounds)} closed-loop runs through kvgate were bound by kvgate's own CPU core "
            f"(busy >= 85%); the rest by the core shared by the {generator} load generator and the stub replicas, "
            f"so there kvgate's throughput is a lower bound. Open-loop and single-request rows measure latency only.")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: settings, comparison table, streaming CPU, profile, what limits the result."""
    meta = report["meta"]
    lines = [
        "### kvgate's own overhead",
        "",
        f"Measured {meta['date']} by `{meta['command']}` "
        f"on {meta['cpus']} CPUs ({meta['pinning']}). Replicas are instant stubs "
        f"(`kvgate/loadtest/kit/stub.py`), {meta['replicas']} in one process; direct runs hit the first one, "
        f"kvgate (`--policy {meta['policy']}`) spreads over all. Each direct run is followed at once by the same "
        f"load through kvgate ({meta['repeats']} pairs per row, each side keeps its least disturbed run); bodies are {meta['body_bytes']} B chat requests, {meta['variants']} distinct prompts. "
        f"1-minute load average before/after: {meta['loadavg_1m'][0]}/{meta['loadavg_1m'][1]} (the machine is shared).",
        "",
        *_comparison_table(report["rows"]),
        "",
        "CPU to relay streamed chunks (kvgate's process vs the stub that produced them, same run):",
        "",
        *_stream_cpu_table(report["stream_cpu"]),
        "",
        f"What limits the result: {limits_sentence(report)}",
    ]
    if report.get("profiles"):
        lines += ["", "Where kvgate's CPU goes (py-spy, share of busy samples):", "", *_profile_lines(report["profiles"])]
    return "\n".join(lines) + "\n"
