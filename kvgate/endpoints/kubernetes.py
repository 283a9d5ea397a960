"""Kubernetes discovery: a Service's EndpointSlices, listed then watched, as kvgate Endpoints."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from kubernetes.aio import client as k8s_client
from kubernetes.aio import config as k8s_config

from kvgate.endpoints.discovery import DiscoveryStatus, EndpointsCallback
from kvgate.endpoints.k8s_slices import SERVICE_NAME_LABEL, SliceReader, merge_endpoints
from kvgate.endpoints.k8s_watch import ResourceWatch, WatchSettings
from kvgate.endpoints.types import Endpoint

log = logging.getLogger(__name__)


async def load_kubernetes_config(kubeconfig: str | None = None) -> None:
    """Set the client's default configuration: `kubeconfig`, else in-cluster, else $KUBECONFIG or ~/.kube/config."""
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config()
            return
        except k8s_config.ConfigException:
            # KUBECONFIG is read now: the client library reads it once, at import time
            kubeconfig = os.environ.get("KUBECONFIG")
    await k8s_config.load_kube_config(config_file=kubeconfig)


class EndpointReporter:
    """Calls a discovery callback with an endpoint list only when it differs from the last one reported."""

    def __init__(self, on_change: EndpointsCallback) -> None:
        self._on_change = on_change
        self._reported: list[Endpoint] | None = None

    def __call__(self, endpoints: list[Endpoint]) -> None:
        """Report `endpoints` unless they are what was reported last."""
        if endpoints != self._reported:
            self._reported = endpoints
            self._on_change(list(endpoints))


class EndpointSliceWatcher:
    """Discovery from one Service's EndpointSlices: list, watch, and list again after any break.

    The port is the slice port named `port_name`, else `port` as given, else the slice's only port.
    """

    def __init__(
        self,
        namespace: str,
        service: str,
        port_name: str | None = None,
        port: int | None = None,
        scheme: str = "http",
        pool: str | None = None,
        read_timeout_s: float = 90.0,  # kube-apiserver sends a bookmark about once a minute
        watch_timeout_s: int = 300,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 10.0,
        api_client_factory: Callable[[], k8s_client.ApiClient] = k8s_client.ApiClient,
    ) -> None:
        self.namespace = namespace
        self.service = service
        self._reader = SliceReader(pool=pool or service, port_name=port_name, port=port, scheme=scheme)
        self._settings = WatchSettings(read_timeout_s, watch_timeout_s, backoff_base_s, backoff_max_s)
        self._api_client_factory = api_client_factory
        self._watch: ResourceWatch | None = None
        self._status = DiscoveryStatus()

    @property
    def status(self) -> DiscoveryStatus:
        """The slice watch's status."""
        return self._watch.status if self._watch is not None else self._status

    async def run(self, on_change: EndpointsCallback) -> None:
        """List and watch until cancelled, calling `on_change` with every endpoint whenever the set changes."""
        report = EndpointReporter(on_change)
        async with self._api_client_factory() as api_client:
            api = k8s_client.DiscoveryV1Api(api_client)

            def list_slices(**query):
                return api.list_namespaced_endpoint_slice_without_preload_content(
                    self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.service}", **query)

            watch = self._watch = ResourceWatch(f"endpointslices service={self.service}", list_slices,
                                                self._reader.read, self._settings)
            await watch.run(lambda: report(merge_endpoints(watch.items.values())))
