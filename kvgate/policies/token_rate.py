"""Characters per engine token, learned per replica from the prompts the gateway sent and the tokens the engine counted.

Without a tokenizer (precise routing), kvgate estimates a prompt's tokens from its length in characters at
`routing.chars_per_token` (4, English text on a Llama-style tokenizer). Code, other languages and other tokenizers
make more or fewer tokens per character, and every count that follows from the estimate is off by as much: a miss's
prefill in the cost model, the KV blocks a prompt takes in admission (`kv_room`) and routing (`kv_seats`).

Each engine counts the prompt tokens of the requests it finishes (vLLM's `vllm:request_prompt_tokens` histogram: its
sum and count), and the gateway knows the characters of the prompts it sent there that the engine answered to the end
(a request cut off is an abort, which vLLM leaves out of that histogram). The gateway's mean characters per answered
prompt over the engine's mean tokens per finished request is the replica's characters per token (MeanRatio).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from kvgate.policies.mean_ratio import MeanRatios

MIN_REQUESTS = 32  # requests each side must have counted before a replica's rate is used
HORIZON = 4096  # requests after which both sides' sums are halved


class PromptTokenRates(MeanRatios):
    """Learns each replica's characters per prompt token."""

    def __init__(self) -> None:
        super().__init__(HORIZON, MIN_REQUESTS)

    def answered(self, replica: str, prompt_chars: int) -> None:
        """The replica answered a request of `prompt_chars` characters to the end."""
        self.measure(replica, prompt_chars)

    def scraped(self, replica: str, finished: int | None, tokens: int | None) -> None:
        """A scrape read the engine's finished requests and their prompt tokens so far (None: not exported)."""
        self.count(replica, finished, tokens)

    def rate(self, replica: str) -> float | None:
        """The replica's characters per prompt token; None until both sides have counted MIN_REQUESTS."""
        return self.ratio(replica)


def fleet_rate(rates: Iterable[float | None]) -> float | None:
    """The median of the replicas' learned rates (replicas of one model share its tokenizer); None when none is."""
    known = [rate for rate in rates if rate is not None]
    return statistics.median(known) if known else None
