"""Publishing a restarting fleet as EndpointSlices in the test API server, with the controller's conditions."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from kvgate.loadtest.rolling.fleet import PublishedReplica, ReplicaPhase
from tests.k8s_api import K8sTestApi, make_slice

# (ready, serving, terminating) as the EndpointSlice controller sets them for each pod phase.
_CONDITIONS = {
    ReplicaPhase.STARTING: (False, False, False),
    ReplicaPhase.READY: (True, True, False),
    ReplicaPhase.TERMINATING: (False, True, True),  # still passing readiness while it drains
}


class SlicePublisher:
    """A Publisher writing one EndpointSlice per replica of `service` (each replica has its own port)."""

    def __init__(self, api: K8sTestApi, service: str = "llm", namespace: str = "default") -> None:
        self.service = service
        self.namespace = namespace
        self._api = api
        self._applied: dict[str, dict] = {}

    def key(self, name: str) -> str:
        """The endpoint key the watcher reports for pod `name`."""
        return f"{self.namespace}/{name}"

    def __call__(self, replicas: Sequence[PublishedReplica]) -> None:
        """Create or update the slice of every listed replica and delete the slices of the others."""
        wanted = {}
        for replica in replicas:
            url = urlsplit(replica.url)
            wanted[replica.name] = make_slice(
                self.service, f"{self.service}-{replica.name}",
                [(url.hostname, replica.name, *_CONDITIONS[replica.phase])],
                ports=[("http", url.port)], namespace=self.namespace)
        for name, obj in wanted.items():
            if self._applied.get(name) != obj:
                self._api.apply_slice(obj)
        for name in self._applied.keys() - wanted.keys():
            self._api.delete_slice(f"{self.service}-{name}", self.namespace)
        self._applied = wanted
