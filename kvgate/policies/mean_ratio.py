"""The ratio of two means per request on one replica: what the gateway measured request by request, over what the
engine's counters give per finished request.

Totals cannot be compared, since other gateways send to the same replicas, but means can: every gateway behind one
Service sees the same mix of requests. Both sides count from the gateway's first scrape of the replica; both are halved
once either passes the horizon, so the ratio follows a workload that changes; an engine whose counters went back (a
restart) starts a new baseline and keeps what was learned.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MeanRatio:
    """One replica's two sums and counts since the gateway began counting it."""

    horizon: int  # requests on either side after which both sides' sums are halved
    measured_sum: float = 0.0  # what the gateway measured of its requests
    measured: float = 0.0
    counted_sum: float = 0.0  # what the engine counted of the requests it finished
    counted: float = 0.0
    counters: tuple[float, float] | None = None  # the engine's (requests, total) at the last scrape that showed them

    def measure(self, value: float) -> None:
        """The gateway measured `value` of one request."""
        self.measured_sum += value
        self.measured += 1
        self._halve_past_horizon()

    def count(self, requests: float | None, total: float | None) -> None:
        """A scrape read the engine's finished requests and their total so far (None: not exported)."""
        if requests is None or total is None:
            return
        if self.counters is not None:
            more_requests, more_total = requests - self.counters[0], total - self.counters[1]
            if more_requests >= 0 and more_total >= 0:  # else the engine restarted: its counters began again
                self.counted += more_requests
                self.counted_sum += more_total
                self._halve_past_horizon()
        self.counters = (requests, total)

    def ratio(self, min_requests: int) -> float | None:
        """The gateway's mean over the engine's; None until both sides have counted `min_requests` and both sums are
        positive."""
        if min(self.measured, self.counted) < min_requests or self.measured_sum <= 0 or self.counted_sum <= 0:
            return None
        return (self.measured_sum / self.measured) / (self.counted_sum / self.counted)

    def _halve_past_horizon(self) -> None:
        """Keep the means, give the past half the weight, once either side passes the horizon."""
        if max(self.measured, self.counted) > self.horizon:
            self.measured_sum, self.measured, self.counted_sum, self.counted = (
                self.measured_sum / 2, self.measured / 2, self.counted_sum / 2, self.counted / 2)


class MeanRatios:
    """A MeanRatio for each replica, used once both sides have counted `min_requests`."""

    def __init__(self, horizon: int, min_requests: int) -> None:
        self._horizon = horizon
        self._min_requests = min_requests
        self._ratios: dict[str, MeanRatio] = {}

    def measure(self, replica: str, value: float) -> None:
        """The gateway measured `value` of one request on `replica`."""
        self._ratio(replica).measure(value)

    def count(self, replica: str, requests: float | None, total: float | None) -> None:
        """A scrape of `replica` read the engine's finished requests and their total so far (None: not exported)."""
        self._ratio(replica).count(requests, total)

    def ratio(self, replica: str) -> float | None:
        """The replica's ratio of means; None until both sides have counted enough."""
        ratio = self._ratios.get(replica)
        return None if ratio is None else ratio.ratio(self._min_requests)

    def forget(self, replica: str) -> None:
        """Drop a replica that left."""
        self._ratios.pop(replica, None)

    def _ratio(self, replica: str) -> MeanRatio:
        ratio = self._ratios.get(replica)
        if ratio is None:
            ratio = self._ratios[replica] = MeanRatio(self._horizon)
        return ratio
