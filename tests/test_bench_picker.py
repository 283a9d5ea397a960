"""The picker benchmark's quick run: every row runs, and the tables and targets come out of what it measured."""

from __future__ import annotations

from kvgate.loadtest.picker import (
    COST_ROWS,
    ENVOY,
    PICKER,
    PRECISE,
    PROXY,
    QUICK,
    ROUTING_ROWS,
    SHARED,
    TWO_PICKERS,
    render_markdown,
    run_picker,
)


async def test_quick_run_measures_every_row_and_renders_the_targets(envoy_binary, tmp_path) -> None:
    report = await run_picker(QUICK, 4.0, envoy_binary, tmp_path, "kvgate bench picker --quick")
    routing = {row["row"]: row for row in report["routing"]}
    cost = {row["row"]: row for row in report["cost"]}
    assert list(routing) == list(ROUTING_ROWS) and list(cost) == list(COST_ROWS)
    assert all(row["errors"] == 0 and row["requests"] > 0 for row in routing.values())
    # conversations stay on their replica through the picker as through the proxy; round-robin spreads them
    assert routing[PICKER]["hit_rate"] > routing[ENVOY]["hit_rate"]
    assert routing[PROXY]["hit_rate"] > routing[ENVOY]["hit_rate"]
    # pickers following the replicas' KV events route by what the replicas hold, whichever picker Envoy asks
    assert routing[TWO_PICKERS + PRECISE]["hit_rate"] > routing[ENVOY]["hit_rate"]
    # and so do pickers that tell each other where they sent each request
    assert routing[TWO_PICKERS + SHARED]["hit_rate"] > routing[ENVOY]["hit_rate"]
    assert cost[ENVOY]["kvgate_cpu_ms_per_request"] is None and cost[PICKER]["kvgate_cpu_ms_per_request"] is not None
    markdown = render_markdown(report)
    assert "added TTFB of the picker path over Envoy alone" in markdown and markdown.count("\n| ") >= 8
