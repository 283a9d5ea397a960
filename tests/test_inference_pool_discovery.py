"""InferencePool discovery against the test API server, through the real `kubernetes` client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from kvgate.endpoints.inference_pool import InferencePoolWatcher
from kvgate.endpoints.k8s_pools import read_pool
from kvgate.endpoints.k8s_watch import ObjectError, WatchSettings
from kvgate.endpoints.types import Endpoint
from tests.harness import Reports, running, wait_until
from tests.k8s_api import K8sTestApi, make_objective, make_pod, make_pool

VLLM = {"app": "vllm"}
SETTINGS = WatchSettings(read_timeout_s=1.0, watch_timeout_s=30, backoff_base_s=0.05, backoff_max_s=0.2)


def pods_ab(labels: dict[str, str] = VLLM) -> list[dict]:
    return [make_pod("a", "10.0.0.1", labels), make_pod("b", "10.0.0.2", labels)]


def urls(reports: Reports) -> dict[str, tuple[str, bool]]:
    return {key: (e.url, e.accepting) for key, e in reports.latest.items()}


def pod_watches(api: K8sTestApi) -> list[dict[str, str]]:
    return [query for query in api.watch_requests if "labelSelector" in query]


@contextlib.asynccontextmanager
async def synced(api: K8sTestApi, *objects: dict,
                 watches: int = 3) -> AsyncIterator[tuple[Reports, InferencePoolWatcher]]:
    """A watcher of pool "llm" running against `api` holding `objects`, past its first report and `watches`
    watching (pool, objectives and, while the pool exists, pods)."""
    for obj in objects:
        api.apply(obj)
    reports, discovery = Reports(), InferencePoolWatcher("default", "llm", SETTINGS)
    async with running(discovery, reports):
        await reports.wait_for(lambda latest: bool(reports.history))
        await wait_until(lambda: discovery.status.synced and api.open_watches == watches)
        yield reports, discovery


async def test_ready_pods_of_the_selector_are_endpoints_on_every_target_port(api):
    objects = [make_pool("llm", VLLM, ports=(8000, 8001)), *pods_ab(),
               make_pod("c", "10.0.0.3", VLLM, ready=False), make_pod("d", None, VLLM),
               make_pod("e", "10.0.0.5", {"app": "other"}), make_pool("other", {"app": "other"})]
    async with synced(api, *objects) as (reports, discovery):
        pass
    assert reports.history == [[
        Endpoint("default/a:8000", "http://10.0.0.1:8000", True, "llm"),
        Endpoint("default/a:8001", "http://10.0.0.1:8001", True, "llm"),
        Endpoint("default/b:8000", "http://10.0.0.2:8000", True, "llm"),
        Endpoint("default/b:8001", "http://10.0.0.2:8001", True, "llm"),
        Endpoint("default/c:8000", "http://10.0.0.3:8000", False, "llm"),
        Endpoint("default/c:8001", "http://10.0.0.3:8001", False, "llm"),
    ]]
    assert discovery.status.healthy and discovery.status.detail == ""
    [pool_watch] = [q for q in api.watch_requests if "fieldSelector" in q]
    assert pool_watch["fieldSelector"] == "metadata.name=llm" and pod_watches(api)[0]["labelSelector"] == "app=vllm"


async def test_terminating_pod_stops_taking_requests_then_leaves(api):
    async with synced(api, make_pool("llm", VLLM), *pods_ab()) as (reports, _):
        api.apply(make_pod("b", "10.0.0.2", VLLM, deleting=True))
        await reports.wait_for(lambda latest: not latest["default/b"].accepting)
        api.apply(make_pod("c", "10.0.0.3", VLLM, ready=False))
        api.apply(make_pod("c", "10.0.0.3", VLLM))
        api.delete("Pod", "b")
        await reports.wait_for(lambda latest: set(latest) == {"default/a", "default/c"})
    assert urls(reports) == {"default/a": ("http://10.0.0.1:8000", True), "default/c": ("http://10.0.0.3:8000", True)}


async def test_selector_and_port_changes_apply_without_a_restart(api):
    blue = {"app": "vllm", "track": "blue"}
    async with synced(api, make_pool("llm", VLLM), *pods_ab(), make_pod("z", "10.0.0.9", blue)) as (reports, _):
        assert set(reports.latest) == {"default/a", "default/b", "default/z"}
        api.apply(make_pool("llm", blue))
        await reports.wait_for(lambda latest: set(latest) == {"default/z"})
        pod_lists = api.list_requests
        api.apply(make_pool("llm", blue, ports=(9000,)))
        await reports.wait_for(lambda latest: latest["default/z"].url == "http://10.0.0.9:9000")
        assert api.list_requests == pod_lists  # a port change re-reads the pods already known
        await wait_until(lambda: len(pod_watches(api)) == 2)
    assert [q["labelSelector"] for q in pod_watches(api)] == ["app=vllm", "app=vllm,track=blue"]
    assert all(report for report in reports.history)  # the switch never reported an empty pool


async def test_expired_pod_watch_relists_and_drops_what_was_deleted_meanwhile(api):
    async with synced(api, make_pool("llm", VLLM), *pods_ab()) as (reports, discovery):
        api.end_watches()
        api.delete("Pod", "b")
        api.compact()
        await reports.wait_for(lambda latest: set(latest) == {"default/a"})
        await wait_until(lambda: discovery.status.healthy and api.open_watches == 3)
    assert discovery.status.relists >= 1


async def test_api_outage_keeps_the_last_pods_then_catches_up(api):
    async with synced(api, make_pool("llm", VLLM), *pods_ab()) as (reports, discovery):
        await api.stop()
        api.apply(make_pod("b", "10.0.0.2", VLLM, deleting=True))
        api.apply(make_pod("c", "10.0.0.3", VLLM))
        await wait_until(lambda: not discovery.status.healthy)
        assert len(reports.history) == 1
        await api.start()
        await reports.wait_for(lambda latest: set(latest) == {"default/a", "default/b", "default/c"}
                               and not latest["default/b"].accepting)
        await wait_until(lambda: discovery.status.healthy)
    assert all(report for report in reports.history)


async def test_missing_or_deleted_pool_has_no_endpoints_and_says_so(api):
    async with synced(api, *pods_ab(), watches=2) as (reports, discovery):
        assert reports.history == [[]] and "inferencepool llm not found" in discovery.status.detail
        api.apply(make_pool("llm", VLLM))
        await reports.wait_for(lambda latest: len(latest) == 2)
        api.delete("InferencePool", "llm")
        await reports.wait_for(lambda latest: not latest)


async def test_objectives_of_the_pool_map_names_to_priorities(api):
    objectives = [make_objective("chat", "llm", 10), make_objective("batch", "llm", -1),
                  make_objective("plain", "llm", None), make_objective("theirs", "other", 5)]
    async with synced(api, make_pool("llm", VLLM), *objectives) as (_, discovery):
        assert discovery.objectives == {"chat": 10, "batch": -1, "plain": 0}
        api.apply(make_objective("chat", "llm", 20))
        api.delete("InferenceObjective", "batch")
        await wait_until(lambda: discovery.objectives == {"chat": 20, "plain": 0})


@pytest.mark.parametrize(("spec", "reason"), [
    ({"targetPorts": [{"number": 8000}]}, "matchLabels"),
    ({"selector": {"matchLabels": VLLM}, "targetPorts": []}, "1 to 8"),
    ({"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": 8000}, {"number": 8000}]}, "distinct"),
    ({"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": "8000"}]}, "distinct"),
])
def test_unusable_pools_are_refused_with_the_reason(spec, reason):
    with pytest.raises(ObjectError, match=reason):
        read_pool({"metadata": {"name": "llm"}, "spec": spec})
