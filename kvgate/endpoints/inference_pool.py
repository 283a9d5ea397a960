"""Discovery from a Gateway API InferencePool: the pool, the Pods its selector matches, and its objectives.

The pool is watched by name; its pods by the pool's label selector, with a new list and watch whenever the
selector changes; target port changes apply to the pods already known. InferenceObjectives that name the
pool give `objectives` (name -> priority) for classifying requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping

from kubernetes.aio import client as k8s_client

from kvgate.endpoints.discovery import DiscoveryStatus, EndpointsCallback, combined_status
from kvgate.endpoints.k8s_pools import (OBJECTIVE_GROUP, OBJECTIVE_PLURAL, OBJECTIVE_VERSION, POOL_GROUP,
                                        POOL_PLURAL, POOL_VERSION, Pod, PoolSpec, pool_endpoints, read_objective,
                                        read_pod, read_pool)
from kvgate.endpoints.k8s_watch import ResourceWatch, WatchSettings
from kvgate.endpoints.kubernetes import EndpointReporter

log = logging.getLogger(__name__)


class InferencePoolWatcher:
    """Endpoints `podIP:targetPort` of one InferencePool's ready pods, and the pool's objectives."""

    def __init__(self, namespace: str, pool: str, settings: WatchSettings = WatchSettings(),
                 api_client_factory: Callable[[], k8s_client.ApiClient] = k8s_client.ApiClient) -> None:
        self.namespace = namespace
        self.pool = pool
        self._settings = settings
        self._api_client_factory = api_client_factory
        self._pool_watch: ResourceWatch[PoolSpec] | None = None
        self._pod_watch: ResourceWatch[Pod | None] | None = None
        self._objective_watch: ResourceWatch[tuple[str, int]] | None = None

    @property
    def status(self) -> DiscoveryStatus:
        """The pool, pod and objective watches' statuses as one; detail says when the pool does not exist."""
        watches = [w for w in (self._pool_watch, self._pod_watch, self._objective_watch) if w is not None]
        if not watches:
            return DiscoveryStatus()
        status = combined_status([w.status for w in watches])
        if self._pool_watch is not None and self._pool_watch.status.synced and self._spec() is None:
            status.detail = "; ".join(filter(None, [status.detail, f"inferencepool {self.pool} not found"]))
        return status

    @property
    def objectives(self) -> Mapping[str, int]:
        """The priority of every InferenceObjective of this pool, by objective name."""
        watch = self._objective_watch
        if watch is None:
            return {}
        return {name: priority for name, (pool, priority) in watch.items.items() if pool == self.pool}

    async def run(self, on_change: EndpointsCallback) -> None:
        """Watch until cancelled, calling `on_change` with every endpoint whenever the set changes."""
        report = EndpointReporter(on_change)
        async with self._api_client_factory() as api_client:
            custom, core = k8s_client.CustomObjectsApi(api_client), k8s_client.CoreV1Api(api_client)
            list_pools = functools.partial(custom.list_namespaced_custom_object_without_preload_content,
                                           POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL,
                                           field_selector=f"metadata.name={self.pool}")
            list_objectives = functools.partial(custom.list_namespaced_custom_object_without_preload_content,
                                                OBJECTIVE_GROUP, OBJECTIVE_VERSION, self.namespace, OBJECTIVE_PLURAL)
            self._pool_watch = ResourceWatch(f"inferencepool={self.namespace}/{self.pool}", list_pools, read_pool,
                                             self._settings)
            self._objective_watch = ResourceWatch(f"inferenceobjectives namespace={self.namespace}",
                                                  list_objectives, read_objective, self._settings)
            pods: asyncio.Task | None = None
            selector: str | None = None

            def changed() -> None:
                nonlocal pods, selector
                spec = self._spec()
                wanted = spec.label_selector if spec is not None else None
                if wanted != selector:  # a new selector: list and watch the pods it matches
                    selector = wanted
                    if pods is not None:
                        pods.cancel()
                    self._pod_watch, pods = None, None
                    if wanted is not None:
                        log.info("inferencepool selector pool=%s selector=%s", self.pool, wanted)
                        self._pod_watch = self._watch_pods(core, wanted)
                        pods = asyncio.create_task(self._pod_watch.run(changed), name="inferencepool-pods")
                if spec is None:
                    report([])
                elif self._pod_watch is not None and self._pod_watch.status.synced:
                    report(pool_endpoints(self.pool, spec, self._pod_watch.items.values()))

            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._pool_watch.run(changed))
                    group.create_task(self._objective_watch.run(lambda: None))
            finally:
                if pods is not None:
                    pods.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await pods

    def _watch_pods(self, core: k8s_client.CoreV1Api, selector: str) -> ResourceWatch[Pod | None]:
        list_pods = functools.partial(core.list_namespaced_pod_without_preload_content, self.namespace,
                                      label_selector=selector)
        return ResourceWatch(f"pods pool={self.pool} selector={selector}", list_pods, read_pod, self._settings)

    def _spec(self) -> PoolSpec | None:
        return self._pool_watch.items.get(self.pool) if self._pool_watch is not None else None
