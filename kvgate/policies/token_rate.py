"""Characters per engine token, learned per replica from the prompts the gateway sent and the tokens the engine counted.

Without a tokenizer (precise routing), kvgate estimates a prompt's tokens from its length in characters at
`routing.chars_per_token` (4, English text on a Llama-style tokenizer). Code, other languages and other tokenizers
make more or fewer tokens per character, and every count that follows from the estimate is off by as much: a miss's
prefill in the cost model, the KV blocks a prompt takes in admission (`kv_room`) and routing (`kv_seats`).

Each engine counts the prompt tokens of the requests it finishes (vLLM's `vllm:request_prompt_tokens` histogram: its
sum and count), and the gateway knows the characters of the prompts it sent there that the engine answered to the end
(a request cut off is an abort, which vLLM leaves out of that histogram). Totals cannot be compared, since other
gateways send to the same replicas, but means can: every gateway behind one Service sees the same mix of requests, so
the gateway's mean characters per answered prompt over the engine's mean tokens per finished request is the
replica's characters per token. Both sides count from the gateway's first scrape of the replica; both are halved
once either passes `HORIZON` requests, so the rate follows a workload that changes; an engine whose counters went
back (a restart) starts a new baseline and keeps what was learned.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

MIN_REQUESTS = 32  # requests each side must have counted before a replica's rate is used
HORIZON = 4096  # requests after which both sides' sums are halved


@dataclass(slots=True)
class _Tally:
    """One replica's sums since the gateway began counting it."""

    chars: float = 0.0  # prompt characters of the requests the gateway saw answered to the end
    answered: float = 0.0
    tokens: float = 0.0  # prompt tokens of the requests the engine finished
    finished: float = 0.0
    counters: tuple[int, int] | None = None  # the engine's (requests, tokens) at the last scrape that showed them

    def halve_past_horizon(self) -> None:
        """Keep the means, give the past half the weight, once either side passes HORIZON requests."""
        if max(self.answered, self.finished) > HORIZON:
            self.chars, self.answered, self.tokens, self.finished = (
                self.chars / 2, self.answered / 2, self.tokens / 2, self.finished / 2)


class PromptTokenRates:
    """Learns each replica's characters per prompt token."""

    def __init__(self) -> None:
        self._tallies: dict[str, _Tally] = {}

    def answered(self, replica: str, prompt_chars: int) -> None:
        """The replica answered a request of `prompt_chars` characters to the end."""
        tally = self._tallies.setdefault(replica, _Tally())
        tally.chars += prompt_chars
        tally.answered += 1
        tally.halve_past_horizon()

    def scraped(self, replica: str, finished: int | None, tokens: int | None) -> None:
        """A scrape read the engine's finished requests and their prompt tokens so far (None: not exported)."""
        if finished is None or tokens is None:
            return
        tally = self._tallies.setdefault(replica, _Tally())
        if tally.counters is not None:
            more_finished, more_tokens = finished - tally.counters[0], tokens - tally.counters[1]
            if more_finished >= 0 and more_tokens >= 0:  # else the engine restarted: its counters began again
                tally.finished += more_finished
                tally.tokens += more_tokens
                tally.halve_past_horizon()
        tally.counters = (finished, tokens)

    def rate(self, replica: str) -> float | None:
        """The replica's characters per prompt token; None until both sides have counted MIN_REQUESTS."""
        tally = self._tallies.get(replica)
        if tally is None or min(tally.answered, tally.finished) < MIN_REQUESTS or tally.tokens <= 0 \
                or tally.chars <= 0:
            return None
        return (tally.chars / tally.answered) / (tally.tokens / tally.finished)

    def forget(self, replica: str) -> None:
        """Drop a replica that left."""
        self._tallies.pop(replica, None)


def fleet_rate(rates: Iterable[float | None]) -> float | None:
    """The median of the replicas' learned rates (replicas of one model share its tokenizer); None when none is."""
    known = [rate for rate in rates if rate is not None]
    return statistics.median(known) if known else None
