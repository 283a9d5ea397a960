"""The share of a request's time through the gateway that the replica's scheduler holds it, learned per replica.

A request the gateway has open on a replica is not in the engine's scheduler for all that time: vLLM's server
receives it, renders and tokenizes its prompt and hands it to the engine core before the scheduler queues it, and
detokenizes and sends its answer after the scheduler finished it. On CPU engines sharing their cores that was 40 % of
the time (docs/benchmarks.md), so a gateway that counted every open request as holding a seat left the schedulers
45 % idle. vLLM counts the time each finished request spent in its scheduler, waiting and running (the sums of
`vllm:request_queue_time_seconds` and `vllm:request_inference_time_seconds`, one observation per finished request,
aborts left out as for every request histogram), and the gateway times the requests it sent there that were answered
to the end: the engine's mean over the gateway's (MeanRatio) is the share of its open requests a replica's scheduler
holds, which is what takes seats.
"""

from __future__ import annotations

from kvgate.policies.mean_ratio import MeanRatios

MIN_REQUESTS = 32  # requests each side must have counted before a replica's share is used
HORIZON = 512  # requests after which both sides' sums are halved: the share moves with the load on the replica's CPU
LOWEST = 0.25  # the share never counted lower, whatever the means say: at most four open requests for each seat


class SchedulerShares(MeanRatios):
    """Learns, for each replica, the share of the requests the gateway has open there that its scheduler holds."""

    def __init__(self) -> None:
        super().__init__(HORIZON, MIN_REQUESTS)

    def answered(self, replica: str, seconds: float) -> None:
        """The replica answered a request to the end `seconds` after the gateway sent it."""
        self.measure(replica, seconds)

    def scraped(self, replica: str, finished: float | None, scheduled_seconds: float | None) -> None:
        """A scrape read the requests the engine finished and their seconds in its scheduler so far (None: not
        exported)."""
        self.count(replica, finished, scheduled_seconds)

    def share(self, replica: str) -> float:
        """The share of the gateway's open requests on the replica that its scheduler holds, at least LOWEST; 1.0
        until both sides have counted MIN_REQUESTS (every open request then counts as holding a seat)."""
        measured = self.ratio(replica)
        return 1.0 if measured is None else min(1.0, max(LOWEST, 1.0 / measured))
