"""The priority benchmark's Markdown report."""

from __future__ import annotations

from typing import Any

from kvgate.loadtest.priority.summary import BATCH_THROUGHPUT_TOLERANCE, TTFT_RATIO_AIM, TTFT_RATIO_LIMIT


def _mark(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _counts(stats: dict[str, Any]) -> str:
    return f"{stats['ok']} / {stats['shed']} / {stats['errors']} / {stats['lost']}"


def _table(report: dict[str, Any]) -> list[str]:
    """One line per run: interactive latency, outcomes of both classes, batch throughput, where requests waited."""
    base = report["unloaded"]["interactive"]["ttft_p99_ms"]
    lines = [
        "| run | interactive TTFT p50 / p99 (ms) | p99 vs unloaded | interactive e2e p99 (ms) "
        "| interactive ok / 429 / err / lost | batch ok / 429 / err / lost | batch req/s | batch preempted | replica queue mean / max "
        "| kvgate queue max | interactive mean wait in kvgate (ms) | stale scrapes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in [report["unloaded"], *report["runs"]]:
        inter, batch, queues = run["interactive"], run["batch"], run["queues"]
        ratio = inter["ttft_p99_ms"] / base if base else float("inf")
        name = run["key"] if run["key"] == "unloaded" else f"({run['key']})"
        lines.append(
            f"| {name} {run['title']}, {run['offered_rps']} req/s | {inter['ttft_p50_ms']:.0f} / "
            f"{inter['ttft_p99_ms']:.0f} | {ratio:.1f}x | {inter['e2e_p99_ms']:.0f} | {_counts(inter)} | "
            f"{_counts(batch)} | {run['batch_throughput']:.1f} | {run['batch_preempted']} | {queues['replica_waiting_mean']} / "
            f"{queues['replica_waiting_max']} | {queues['gateway_queue_max']} | "
            f"{run['interactive_kvgate_wait_ms']:.0f} | {queues['stale_fraction']:.0%} |")
    return lines


def _verdict_lines(report: dict[str, Any]) -> list[str]:
    """Each target for each run with admission control."""
    lines = []
    for v in report["verdicts"]:
        lines.append(
            f"- ({v['key']}) {_mark(v['passed'])}: interactive TTFT p99 {v['ttft_ratio']}x unloaded "
            f"(target <= {TTFT_RATIO_LIMIT}x, aim {TTFT_RATIO_AIM}x) {_mark(v['ttft_ok'])}; every request answered "
            f"(200 or 429) {_mark(v['all_answered'])}; batch throughput {v['batch_ratio']}x FIFO's (b) "
            f"(target >= {BATCH_THROUGHPUT_TOLERANCE}) {_mark(v['batch_ok'])}.")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: setup, capacity, the table, and pass/fail per target."""
    plan, capacity, meta = report["plan"], report["capacity"], report["meta"]
    sim = plan["sim"]
    lines = [
        "### Priority classes under overload",
        "",
        f"Measured {meta['date']} by `{meta['command']}` on {meta['cpus']} CPUs; the simulated fleet, kvgate and "
        f"the load generator share them (1-minute load average before/after: {meta['loadavg_1m'][0]}/"
        f"{meta['loadavg_1m'][1]}). Fleet: {plan['replicas']} simulated replicas (`kvgate sim`), "
        f"max_num_seqs {sim['max_num_seqs']}, speed {sim['speed']}, decode step {sim['decode_step_seconds']} s + "
        f"{sim['decode_seconds_per_seq']} s per running sequence; every request is a chat completion of "
        f"{plan['max_tokens'] // 2} to {plan['max_tokens'] * 3 // 2} tokens (uniform, mean {plan['max_tokens']}) "
        "with its own prompt (no prefix reuse); interactive requests stream, batch requests read whole answers "
        "as batch jobs do (streamed in row f).",
        "",
        f"Capacity: {capacity['measured_rps']} req/s measured (closed loop, {2 * capacity['seats']} requests "
        f"always open directly against the replicas, {plan['capacity_s']} s after a {plan['capacity_warmup_s']} s warm-up, "
        f"the longest request's time); {capacity['derived_rps']} req/s from the "
        f"simulator's timing model (the difference is CPU contention on this machine). Loads below are multiples "
        f"of the measured value.",
        "",
        f"Load: open loop, Poisson arrivals, each run on a fresh fleet and gateway. Unloaded: interactive only at "
        f"{plan['unloaded_fraction']:.0%} of capacity for {plan['unloaded_s']} s. Overload: {plan['overload_factor']}x "
        f"capacity, {plan['batch_fraction']:.0%} batch (`x-priority: batch`), for {plan['overload_s']} s, after "
        f"{plan['lead_in_s']} s of its interactive share alone (the flood lands on interactive traffic already "
        f"flowing), then up to {plan['drain_cap_s']:.0f} s for open requests to finish (a request still open then "
        f"counts as lost). TTFT is the time to the first content chunk, of requests sent during the flood; every "
        f"request counts in ok / 429 / err / lost. Batch req/s counts completed batch requests from the flood's "
        f"start to the end of its drain; batch preempted counts the times kvgate took a batch request's seat back for an "
        f"interactive one (it then queued again). Replica queue: requests waiting inside the replicas (`/sim/stats`), kvgate queue: its "
        f"admission queue, stale scrapes: share of samples where kvgate judged a replica on stale metrics "
        f"(headroom then counts only what was sent since the last good scrape); all sampled every 0.5 s while the load was on.",
        "",
        *_table(report),
        "",
        *_verdict_lines(report),
    ]
    return "\n".join(lines) + "\n"
