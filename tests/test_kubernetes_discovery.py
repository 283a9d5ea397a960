"""Kubernetes discovery against a real-socket API server, through the real `kubernetes` client and a kubeconfig."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import pytest

from kvgate.endpoints.k8s_slices import SliceReader
from kvgate.endpoints.kubernetes import EndpointSliceWatcher
from kvgate.endpoints.types import Endpoint
from kvgate.endpoints.multi_discovery import MultiDiscovery
from tests.harness import Reports, running
from tests.k8s_api import K8sTestApi, make_slice

READ_TIMEOUT_S = 1.0


async def eventually(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    """Poll `condition` every 10 ms until it holds; fails the test after `timeout`."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def watcher(service: str = "llm", **overrides) -> EndpointSliceWatcher:
    settings = dict(port_name="http", read_timeout_s=READ_TIMEOUT_S, watch_timeout_s=30,
                    backoff_base_s=0.05, backoff_max_s=0.2)
    return EndpointSliceWatcher("default", service, **{**settings, **overrides})


@contextlib.asynccontextmanager
async def synced(api: K8sTestApi, *slices: dict,
                 **overrides) -> AsyncIterator[tuple[Reports, EndpointSliceWatcher]]:
    """A watcher of service "llm" running against `api` with `slices`, past its first list and watching."""
    for obj in slices:
        api.apply_slice(obj)
    reports, discovery = Reports(), watcher(**overrides)
    async with running(discovery, reports):
        await reports.wait_for(lambda latest: bool(reports.history))
        await eventually(lambda: api.open_watches == 1)
        yield reports, discovery


def accepting(reports: Reports) -> dict[str, bool]:
    return {key: e.accepting for key, e in reports.latest.items()}


ABC = [(f"10.0.0.{n}", pod, True, True, False) for n, pod in enumerate("abc", start=1)]  # three ready pods


TWO_SLICES = (make_slice("llm", "llm-1", ABC[:2]), make_slice("llm", "llm-2", ABC[2:]))


async def test_initial_list_reports_every_endpoint_with_its_url_and_pool(api):
    slices = (make_slice("llm", "llm-1", ABC[:2], ports=[("metrics", 9000), ("http", 8000)]),
              make_slice("llm", "llm-2", [("fd00::7", "c", None, None, None)]),
              make_slice("other", "other-1", [("10.9.9.9", "z", True, True, False)]))
    async with synced(api, *slices) as (reports, discovery):
        pass
    assert reports.history == [[
        Endpoint("default/a", "http://10.0.0.1:8000", True, "llm"),
        Endpoint("default/b", "http://10.0.0.2:8000", True, "llm"),
        Endpoint("default/c", "http://[fd00::7]:8000", True, "llm"),
    ]]
    assert discovery.status.synced and discovery.status.healthy
    assert discovery.status.last_event_at is not None
    watch = api.watch_requests[0]
    assert watch["labelSelector"] == "kubernetes.io/service-name=llm"
    assert watch["allowWatchBookmarks"] == "true" and watch["timeoutSeconds"] == "30"
    assert watch["resourceVersion"] == api.resource_version


async def test_pod_turning_not_ready_is_reported_within_a_second_and_kept(api):
    async with synced(api, make_slice("llm", "llm-1", ABC)) as (reports, _):
        api.apply_slice(make_slice("llm", "llm-1", [ABC[0], ("10.0.0.2", "b", False, False, False), ABC[2]]))
        elapsed = await reports.wait_for(lambda latest: not latest["default/b"].accepting)
    assert elapsed < 1.0
    assert accepting(reports) == {"default/a": True, "default/b": False, "default/c": True}


async def test_terminating_pod_is_kept_without_new_requests(api):
    async with synced(api, make_slice("llm", "llm-1", ABC)) as (reports, _):
        draining = [("10.0.0.1", "a", False, True, True), ("10.0.0.2", "b", True, True, True), ABC[2]]
        api.apply_slice(make_slice("llm", "llm-1", draining))  # b: publishNotReadyAddresses keeps ready=true
        await reports.wait_for(lambda latest: not latest["default/a"].accepting)
    assert accepting(reports) == {"default/a": False, "default/b": False, "default/c": True}


async def test_deletion_while_the_api_is_down_disappears_after_relist_and_nothing_empty_is_reported(api):
    async with synced(api, *TWO_SLICES) as (reports, discovery):
        await api.stop()
        api.delete_slice("llm-2")
        await eventually(lambda: not discovery.status.healthy and discovery.status.restarts >= 2)
        assert len(reports.history) == 1  # the last known set is kept while the API is unreachable
        await api.start()
        await reports.wait_for(lambda latest: set(latest) == {"default/a", "default/b"})
        await eventually(lambda: discovery.status.healthy)
    assert all(report for report in reports.history)
    assert discovery.status.relists == 1


async def test_expired_resource_version_recovers_by_relisting(api):
    async with synced(api, *TWO_SLICES) as (reports, discovery):
        synced_rv = api.resource_version
        api.end_watches()  # the watcher comes back from synced_rv, which compaction is about to drop
        api.delete_slice("llm-2")
        api.compact()
        await reports.wait_for(lambda latest: set(latest) == {"default/a", "default/b"})
    assert api.watch_requests[1]["resourceVersion"] == synced_rv  # this one got 410 Expired
    assert discovery.status.relists == 1 and discovery.status.healthy
    assert api.list_requests == 2


async def test_api_server_restart_recovers_and_follows_new_changes(api):
    async with synced(api, make_slice("llm", "llm-1", ABC[:2])) as (reports, discovery):
        await api.restart()
        await eventually(lambda: api.open_watches == 1)
        api.apply_slice(make_slice("llm", "llm-1", ABC))
        await reports.wait_for(lambda latest: len(latest) == 3)
    assert discovery.status.restarts >= 1 and discovery.status.relists >= 1 and discovery.status.healthy


async def test_server_side_watch_timeout_resumes_from_the_last_version_without_relisting(api):
    one_second_watches = dict(watch_timeout_s=1, read_timeout_s=3)
    async with synced(api, make_slice("llm", "llm-1", ABC[:2]), **one_second_watches) as (reports, discovery):
        await eventually(lambda: len(api.watch_requests) == 2 and api.open_watches == 1)
        api.apply_slice(make_slice("llm", "llm-1", ABC))
        await reports.wait_for(lambda latest: len(latest) == 3)
    assert discovery.status.relists == 0 and api.list_requests == 1
    assert discovery.status.healthy and discovery.status.detail == ""


async def test_hung_watch_is_restarted_after_the_read_timeout(api):
    async with synced(api, make_slice("llm", "llm-1", ABC[:2])) as (reports, discovery):
        api.hang_watches()
        api.apply_slice(make_slice("llm", "llm-1", ABC))
        await asyncio.sleep(READ_TIMEOUT_S / 2)
        assert len(reports.latest) == 2  # the hung stream delivered nothing
        await reports.wait_for(lambda latest: len(latest) == 3, timeout=READ_TIMEOUT_S + 2)
    assert discovery.status.restarts == 1 and discovery.status.relists == 1


async def test_bad_objects_are_skipped_and_watching_goes_on(api, caplog):
    bad_endpoints = make_slice("llm", "llm-1", ABC[:2])
    bad_endpoints["endpoints"][1]["addresses"] = []
    bad_endpoints["endpoints"].append({"addresses": ["10.0.0.5"], "conditions": {"ready": "yes"}})
    no_http_port = make_slice("llm", "llm-2", ABC[2:], ports=[("grpc", 9000)])
    caplog.set_level(logging.WARNING, logger="kvgate.endpoints")
    async with synced(api, bad_endpoints, no_http_port) as (reports, discovery):
        assert set(reports.latest) == {"default/a"}
        bad_ports = make_slice("llm", "llm-3", [("10.0.0.6", "e", True, True, False)])
        bad_ports["ports"] = "http"
        api.apply_slice(bad_ports)
        api.inject({"type": "MODIFIED", "object": {"metadata": {}}})  # no name
        api.inject({"type": "ADDED"})
        api.inject({"type": "RESIZED", "object": bad_ports})
        bad_address = [("10.0.0.4", "d", True, True, False), ("not-an-ip", "f", True, True, False)]
        api.apply_slice(make_slice("llm", "llm-4", bad_address))
        await reports.wait_for(lambda latest: set(latest) == {"default/a", "default/d"})
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 8, skipped
    assert discovery.status.restarts == 0


async def test_endpoint_moving_between_slices_never_disappears_and_ready_wins(api):
    async with synced(api, *TWO_SLICES) as (reports, _):
        api.apply_slice(make_slice("llm", "llm-2", ABC[1:]))  # b listed twice while it moves
        api.apply_slice(make_slice("llm", "llm-1", [ABC[0], ("10.0.0.2", "b", False, False, False)]))  # stale copy
        api.apply_slice(make_slice("llm", "llm-1", ABC[:1]))
        api.apply_slice(make_slice("llm", "llm-5", [ABC[1], ("10.0.0.3", "c", False, False, False)]))
        api.delete_slice("llm-2")  # only now does c's ready copy go away
        await reports.wait_for(lambda latest: not latest["default/c"].accepting)
    assert all({e.key for e in report} == {"default/a", "default/b", "default/c"} for report in reports.history)
    assert all(e.accepting for report in reports.history for e in report if e.key == "default/b")
    assert len(reports.history) == 2


async def test_bookmarks_advance_the_resource_version_so_a_compacted_history_needs_no_relist(api):
    async with synced(api, make_slice("llm", "llm-1", ABC)) as (reports, discovery):
        api.apply_slice(make_slice("other", "other-1", ABC))  # our watch never sees this one
        seen_at = discovery.status.last_event_at
        api.bookmark()
        await eventually(lambda: discovery.status.last_event_at != seen_at)
        api.compact()
        api.end_watches()
        await eventually(lambda: len(api.watch_requests) == 2 and api.open_watches == 1)
    assert api.watch_requests[1]["resourceVersion"] == api.resource_version
    assert discovery.status.relists == 0 and api.list_requests == 1
    assert len(reports.history) == 1


async def test_two_services_are_merged_into_one_fleet(api):
    api.apply_slice(make_slice("small", "small-1", ABC[:1]))
    api.apply_slice(make_slice("large", "large-1", ABC[1:]))
    reports = Reports()
    discovery = MultiDiscovery([watcher("small"), watcher("large")])
    async with running(discovery, reports):
        await reports.wait_for(lambda latest: len(latest) == 3)
        await eventually(lambda: discovery.status.synced and api.open_watches == 2)
        api.apply_slice(make_slice("large", "large-1", [ABC[1], ("10.0.0.3", "c", False, False, False)]))
        await reports.wait_for(lambda latest: not latest["default/c"].accepting)
        await api.stop()
        await eventually(lambda: not discovery.status.healthy)
    assert {key: e.pool for key, e in reports.latest.items()} == {
        "default/a": "small", "default/b": "large", "default/c": "large"}
    first_source, both, c_changed = reports.history  # whichever source listed first, then the union, then c
    assert len(first_source) in (1, 2) and len(both) == len(c_changed) == 3


@pytest.mark.parametrize(("ready", "serving", "terminating", "expected"), [
    (None, None, None, True),
    (True, True, False, True),
    (False, False, False, False),  # not ready: kept, so its identity survives a readiness flap
    (False, True, True, False),  # draining: in-flight requests finish, no new ones
    (True, True, True, False),  # draining under publishNotReadyAddresses
    (True, False, False, False),  # not ready under publishNotReadyAddresses
    (False, None, None, False),
])
def test_conditions_decide_whether_an_endpoint_accepts_new_requests(ready, serving, terminating, expected):
    obj = make_slice("s", "s-1", [("10.0.0.1", "a", ready, serving, terminating)])
    [endpoint] = SliceReader(pool="p").read(obj)
    assert endpoint.accepting is expected


def test_port_choice_and_identity_without_a_target_ref():
    no_pod = [("10.0.0.1", None, True, True, False)]
    two_ports = make_slice("s", "s-1", no_pod, ports=[("http", 8000), ("grpc", 9000)])
    assert SliceReader(pool="p").read(two_ports) == ()  # ambiguous without a port name
    assert SliceReader(pool="p", port_name="grpc").read(two_ports) == (
        Endpoint("10.0.0.1", "http://10.0.0.1:9000", True, "p"),)
    assert SliceReader(pool="p", port=8443, scheme="https").read(two_ports)[0].url == "https://10.0.0.1:8443"
    unnamed = make_slice("s", "s-1", [("10.0.0.1", "a", True, True, False)], ports=[("", 8000)])
    assert SliceReader(pool="p").read(unnamed)[0].url == "http://10.0.0.1:8000"
