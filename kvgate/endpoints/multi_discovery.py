"""Several discovery sources seen as one, e.g. one EndpointSliceWatcher per `--service`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvgate.endpoints.discovery import Discovery, DiscoveryStatus, EndpointsCallback, combined_status
from kvgate.endpoints.k8s_slices import merge_endpoints
from kvgate.endpoints.types import Endpoint


class MultiDiscovery:
    """The union of its sources' endpoints; healthy and synced only when every source is."""

    def __init__(self, sources: Sequence[Discovery]) -> None:
        if not sources:
            raise ValueError("MultiDiscovery needs at least one source")
        self.sources = tuple(sources)
        self._latest: list[tuple[Endpoint, ...]] = [() for _ in self.sources]
        self._reported: list[Endpoint] | None = None

    @property
    def status(self) -> DiscoveryStatus:
        """The sources' statuses combined: all healthy, all synced, counters summed, newest event."""
        return combined_status([source.status for source in self.sources])

    async def run(self, on_change: EndpointsCallback) -> None:
        """Run every source; report the union whenever any source's report changes it."""

        def source_changed(index: int) -> EndpointsCallback:
            def changed(endpoints: Sequence[Endpoint]) -> None:
                self._latest[index] = tuple(endpoints)
                union = merge_endpoints(self._latest)
                if union != self._reported:
                    self._reported = union
                    on_change(list(union))
            return changed

        async with asyncio.TaskGroup() as group:
            for index, source in enumerate(self.sources):
                group.create_task(source.run(source_changed(index)))
