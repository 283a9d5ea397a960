"""The KV cache a replica's in-flight requests hold, each shared prefix block once, and what the fleet shows of it."""

from __future__ import annotations

import random

from kvgate.endpoints.fleet import Fleet
from kvgate.endpoints.types import Endpoint, ReplicaMetrics
from kvgate.policies.config import RoutingConfig
from kvgate.policies.held_kv import HeldKv, kv_footprint
from kvgate.policies.types import RequestInfo

CONFIG = RoutingConfig()  # 64-character blocks at 4 characters a token: 16 tokens a block


def chat(tenant: int, question: int, system_blocks: int = 100) -> RequestInfo:
    """A prompt of `system_blocks` blocks its tenant shares, two blocks of its own and a partial one (32 chars)."""
    blocks = tuple(tenant * 1000 + index for index in range(system_blocks)) + (-question, -question - 10_000)
    return RequestInfo(model="m", block_hashes=blocks, prompt_chars=64 * len(blocks) + 32)


def test_a_footprint_is_its_prefix_blocks_and_its_own_tail_with_a_block_to_grow_by() -> None:
    footprint = kv_footprint(chat(1, 1), CONFIG)
    assert len(footprint.blocks) == 102 and footprint.block_tokens == 16
    assert footprint.own_tokens == 8 + 16  # the partial block's 8 tokens, and one block to grow by


def test_requests_sharing_a_system_prompt_hold_its_blocks_once_and_free_them_with_the_last() -> None:
    held = HeldKv()
    first, second, other = (kv_footprint(request, CONFIG) for request in (chat(1, 1), chat(1, 2), chat(2, 3)))
    held.add(first)
    assert held.tokens == 102 * 16 + 24
    held.add(second)
    assert held.tokens == (102 + 2) * 16 + 2 * 24  # only its two own blocks are new
    held.add(other)
    assert held.shared_tokens(kv_footprint(chat(1, 9), CONFIG)) == 100 * 16  # its tenant's system prompt is held
    assert held.shared_tokens(kv_footprint(chat(3, 9), CONFIG)) == 0
    held.remove(first)
    assert held.tokens == (102 + 102) * 16 + 2 * 24
    held.remove(second)
    assert held.tokens == 102 * 16 + 24
    held.remove(other)
    assert held.tokens == 0


def test_the_fleet_shows_the_kv_cache_taken_and_freed_since_each_replicas_scrape() -> None:
    pages: dict[str, ReplicaMetrics] = {}
    fleet = Fleet(lambda key: pages.get(key, ReplicaMetrics()), lambda key: frozenset(), routing=CONFIG)
    fleet.apply([Endpoint("a", "http://a:8000")])

    def scrape() -> None:
        fleet.scrape_started("a")
        pages["a"] = ReplicaMetrics(running=2, scraped_at=1.0, stale=False)
        fleet.scraped("a", ok=True)

    def grown() -> float:
        state = fleet.snapshot().get("a")
        assert state is not None
        return state.kv_grown

    first, second = chat(1, 1), chat(1, 2)
    fleet.acquire("a", first)
    fleet.acquire("a", second)
    assert grown() == (102 + 2) * 16 + 2 * 24
    scrape()
    assert grown() == 0  # the page shows them
    fleet.release("a", first)
    assert grown() == -(2 * 16 + 24)  # the system prompt stays: the second request still holds it
    fleet.release("a", second)
    assert grown() == -((102 + 2) * 16 + 2 * 24)
    assert fleet.prompt_tokens(chat(1, 3)).at("a") == 102 * 16 + 8  # nothing in flight holds any of it now
    fleet.acquire("a", first)
    tokens = fleet.prompt_tokens(chat(1, 3))
    assert tokens.at("a") == 2 * 16 + 8 and tokens.at("b") == tokens.whole == 102 * 16 + 8
    fleet.release("a", first)
    fleet.sent_elsewhere("a")
    state = fleet.snapshot().get("a")
    assert state is not None and state.elsewhere == 1  # another gateway's: its prompt is not known here
    scrape()
    state = fleet.snapshot().get("a")
    assert state is not None and state.kv_grown == 0 and state.elsewhere == 0


def test_held_tokens_match_counting_each_block_of_every_request_in_flight_once() -> None:
    rng = random.Random(11)

    def request() -> RequestInfo:
        """A prompt that opens like others (chained blocks: each names every block before it) and then goes its own
        way, at a point drawn at random."""
        path: tuple[int, ...] = ()
        blocks = []
        for _ in range(rng.randint(0, 12)):
            path += (rng.randint(0, 2),)  # three ways on from each block: prompts share leading runs often
            blocks.append(hash(path))
        return RequestInfo(model="m", block_hashes=tuple(blocks), prompt_chars=64 * len(blocks) + rng.randint(0, 63))

    held, in_flight = HeldKv(), []
    for _ in range(2_000):
        if in_flight and rng.random() < 0.5:
            held.remove(in_flight.pop(rng.randrange(len(in_flight))))
        else:
            in_flight.append(kv_footprint(request(), CONFIG))
            held.add(in_flight[-1])
        distinct = {block for footprint in in_flight for block in footprint.blocks}
        assert held.tokens == len(distinct) * 16 + sum(footprint.own_tokens for footprint in in_flight)


def test_requests_free_the_blocks_no_other_request_holds_and_a_system_prompt_with_the_last_that_does() -> None:
    held = HeldKv()
    first, second, other = (kv_footprint(request, CONFIG) for request in (chat(1, 1), chat(1, 2), chat(2, 3)))
    for footprint in (first, second, other):
        held.add(footprint)
    own = 2 * 16 + 24  # a request's own two blocks, its partial block and one to grow by
    assert held.freed_by([second]) == own  # its tenant's system prompt stays: the first request holds it
    assert held.freed_by([other]) == 100 * 16 + own
    assert held.freed_by([first, second]) == 100 * 16 + 2 * own  # together they free their system prompt too
    assert held.freed_by([]) == 0
