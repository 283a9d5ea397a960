"""Rendezvous (highest random weight) hashing: a stable preference order of endpoints for each prefix.

Every gateway replica computes the same order from the same prefix and candidate keys, and when an
endpoint joins or leaves only the prefixes it tops (about 1/n of them) change their first choice.
"""

from __future__ import annotations

from collections.abc import Iterable

from xxhash import xxh3_64_intdigest

from kvgate.endpoints.types import EndpointState
from kvgate.policies.capacity import occupied
from kvgate.policies.types import RequestInfo


def placement_key(request: RequestInfo, depth: int) -> int:
    """The hash that places a request: its chained hash after `depth` leading blocks (or fewer if shorter)."""
    hashes = request.block_hashes
    if not hashes:
        return xxh3_64_intdigest(request.model.encode("utf-8", "surrogatepass"))
    return hashes[min(max(depth, 1), len(hashes)) - 1]


def rendezvous_weight(key: int, endpoint_key: str) -> int:
    """The endpoint's weight for `key`; the highest weight is the key's home."""
    return xxh3_64_intdigest(endpoint_key.encode("utf-8", "surrogatepass"), key)


def rendezvous_order(key: int, states: Iterable[EndpointState]) -> list[EndpointState]:
    """Endpoints from the key's home downwards; equal weights (a hash collision) fall back to key order."""
    return sorted(states, key=lambda state: (-rendezvous_weight(key, state.key), state.key))


def least_loaded_order(key: int, states: Iterable[EndpointState]) -> list[EndpointState]:
    """Endpoints by load (what each replica holds: capacity.occupied), equal loads in the key's rendezvous order
    (never by list position)."""
    return sorted(states, key=lambda state: (occupied(state), -rendezvous_weight(key, state.key), state.key))


def retry_order(key: int, ranked: Iterable[EndpointState], candidates: Iterable[EndpointState]) -> tuple[EndpointState, ...]:
    """Where a request goes when its replica fails before answering: the rest of `ranked` (after the chosen one),
    then every other candidate least loaded first, since a replica over its load cap beats failing."""
    ranked = list(ranked)
    kept = {state.key for state in ranked}
    return (*ranked[1:], *(state for state in least_loaded_order(key, candidates) if state.key not in kept))
