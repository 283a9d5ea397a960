"""The engine core: vLLM's V1 scheduler reduced to its effect on queues, KV blocks and timing.

Each step spends a token budget (`max_num_batched_tokens`): running sequences first (a decode takes one token, an
unfinished prompt its next chunk), then waiting ones in queue order, each once blocks for its whole prompt are free.

Pure logic: no asyncio, no clock reads (times come in as arguments), so it is tested step by step.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from dataclasses import dataclass, field

from kvgate.engine.kv_events import BlockStored, KvEvent
from kvgate.simulator.kv_cache import PrefixCache, Sha256CborHasher, extend_block_hashes
from kvgate.simulator.options import SimOptions
from kvgate.simulator.tokens import TokenSeq, output_token


class FinishReason(enum.StrEnum):
    """Why a sequence stopped, as `vllm:request_success_total{finished_reason}` labels it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class SeqState(enum.Enum):
    """Where a sequence is in the engine."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False, slots=True)
class Sequence:
    """One prompt being generated from; `max_tokens=0` is a prefill-only (embedding) request."""

    tokens: TokenSeq  # prompt, then generated tokens
    max_tokens: int
    arrival_time: float
    lora: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    num_prompt_tokens: int = 0
    state: SeqState = SeqState.WAITING
    finish_reason: FinishReason | None = None
    output_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    last_token_gap: float | None = None  # inter-token latency of the newest token
    block_hashes: list[int] = field(default_factory=list)
    block_digests: list[bytes] = field(default_factory=list)  # full sha256_cbor digests, with KV events on
    held: list[int | None] = field(default_factory=list)  # pinned blocks: cached hash or None (private)
    settled_blocks: int = 0  # leading full blocks already published to the cache or left private
    num_computed: int = 0  # tokens whose KV is computed, or scheduled in the current step
    num_scheduled: int = 0  # tokens scheduled in the current step
    num_cached_tokens: int = -1  # prompt tokens found cached when first scheduled (-1: not yet), as vLLM counts them
    num_cache_creation_tokens: int = 0  # prompt tokens in full blocks it then cached anew
    arrival_order: int = 0
    seed: int = 0

    @property
    def finished(self) -> bool:
        """Whether the sequence will produce no more tokens."""
        return self.state is SeqState.FINISHED


@dataclass(slots=True)
class EngineTotals:
    """Monotonic counters since the engine started."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, as vLLM counts them
    prefix_cache_hits: int = 0  # tokens found cached
    preemptions: int = 0
    completed: int = 0
    aborts: int = 0


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """The work of one engine step, as vLLM's scheduler hands it to the model runner."""

    num_seqs: int = 0  # sequences scheduled
    num_tokens: int = 0  # tokens computed: prefill chunks and one per decoding sequence
    prefill_tokens: int = 0  # of which prompt (or recomputed) tokens


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one engine step produced."""

    advanced: list[Sequence]  # sequences that got a token or finished
    finished: list[Sequence]


class EngineCore:
    """Waiting queue, running batch and KV cache of one replica, advanced one step at a time."""

    def __init__(self, options: SimOptions) -> None:
        self._options = options
        self._block_size = options.block_size
        # KV events: what the cache stored and evicted since the engine loop last published them.
        self.events: list[KvEvent] | None = [] if options.kv_events else None
        self._hasher = Sha256CborHasher() if options.kv_events else None
        self.cache = PrefixCache(options.num_gpu_blocks, options.enable_prefix_caching, self.events)
        self.totals = EngineTotals()
        self.running: list[Sequence] = []
        self._waiting: list[Sequence] = []  # kept sorted by _queue_key
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Whether there is nothing to run."""
        return not self.running and not self._waiting

    def running_loras(self) -> list[str]:
        """LoRA adapters in the running batch, sorted."""
        return sorted({seq.lora for seq in self.running if seq.lora})

    def waiting_loras(self) -> list[str]:
        """LoRA adapters in the waiting queue, sorted."""
        return sorted({seq.lora for seq in self._waiting if seq.lora})

    def _queue_key(self, seq: Sequence) -> tuple[int, int]:
        priority = seq.priority if self._options.priority_scheduling else 0
        return (priority, seq.arrival_order)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.arrival_order = next(self._arrivals)
        seq.num_prompt_tokens = len(seq.tokens)
        seq.seed = seq.tokens.digest()
        self._hash_blocks(seq)
        self.totals.requests += 1
        self.totals.prompt_tokens += seq.num_prompt_tokens
        bisect.insort(self._waiting, seq, key=self._queue_key)

    def abort(self, seq: Sequence) -> bool:
        """Stop a sequence at once and free its blocks; False if it had already finished."""
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
            self._free(seq)
        elif seq.state is SeqState.WAITING:
            self._waiting.remove(seq)
        else:
            return False
        self._finish(seq, FinishReason.ABORT)
        self.totals.aborts += 1
        return True

    def schedule(self) -> ScheduledStep:
        """Spend the step's token budget as vLLM V1 does: running sequences first, in order, then waiting ones
        while no sequence was preempted and seats last. A prompt longer than the budget left is prefilled in
        chunks over several steps (chunked prefill)."""
        budget = self._options.max_num_batched_tokens
        budget, preempted = self._schedule_running(budget)
        if not preempted:
            self._admit_waiting(budget)
        scheduled = [seq for seq in self.running if seq.num_scheduled]
        num_tokens = sum(seq.num_scheduled for seq in scheduled)
        decoding = sum(1 for seq in scheduled if seq.output_ids and seq.num_scheduled == 1)
        return ScheduledStep(num_seqs=len(scheduled), num_tokens=num_tokens, prefill_tokens=num_tokens - decoding)

    def step_seconds(self, step: ScheduledStep) -> float:
        """Nominal duration of a step: a fixed cost, a cost per scheduled sequence and per prefilled token."""
        options = self._options
        return (
            options.decode_step_seconds
            + options.decode_seconds_per_seq * step.num_seqs
            + options.prefill_seconds_per_token * step.prefill_tokens
        )

    def complete_step(self, now: float) -> StepOutcome:
        """Finish the scheduled work: a sequence whose prompt is now computed gets a token; retire those done."""
        advanced, finished = [], []
        for seq in self.running:
            if not seq.num_scheduled:
                continue
            seq.num_scheduled = 0
            if seq.num_computed < len(seq.tokens):
                continue  # a prefill chunk: no token until the whole prompt is computed
            advanced.append(seq)
            if seq.max_tokens > 0:
                self._emit_token(seq, now)
            if len(seq.output_ids) >= seq.max_tokens:
                self._free(seq)
                self._finish(seq, FinishReason.LENGTH if seq.max_tokens else FinishReason.STOP)
                self.totals.completed += 1
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if seq.state is SeqState.RUNNING]
        return StepOutcome(advanced=advanced, finished=finished)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no running sequence uses."""
        self.cache.clear_unpinned()

    def _emit_token(self, seq: Sequence, now: float) -> None:
        token_id = output_token(seq.seed, len(seq.output_ids))
        seq.tokens.append(token_id)
        seq.output_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        else:
            seq.last_token_gap = now - seq.last_token_time
        seq.last_token_time = now
        self.totals.generation_tokens += 1

    def _schedule_running(self, budget: int) -> tuple[int, bool]:
        """Give running sequences, in order, their next tokens and blocks, preempting the least important when the
        cache is full; return the budget left and whether anything was preempted."""
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(len(seq.tokens) - seq.num_computed, budget)
            needed = _ceil_div(seq.num_computed + num_new, self._block_size) - len(seq.held)
            while not self.cache.can_allocate((), needed):
                victim = self._preemption_victim()
                if self.running.index(victim) < index:
                    index -= 1
                budget += victim.num_scheduled  # its work this step is given back
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return budget, preempted
            self._schedule(seq, num_new)
            budget -= num_new
            index += 1
        return budget, preempted

    def _preemption_victim(self) -> Sequence:
        if self._options.priority_scheduling:
            return max(self.running, key=self._queue_key)
        return self.running[-1]

    def _preempt(self, seq: Sequence) -> None:
        """Stop a running sequence and free its blocks; it waits to be recomputed from its cached prefix."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_scheduled = 0
        seq.state = SeqState.WAITING
        bisect.insort(self._waiting, seq, key=self._queue_key)
        self.totals.preemptions += 1

    def _admit_waiting(self, budget: int) -> None:
        """Move waiting sequences into the batch in queue order while budget, seats and blocks last. A sequence is
        admitted once blocks for all of it are free (vLLM's `--scheduler-reserve-full-isl`, on by default) and
        holds those of its first chunk."""
        options = self._options
        loras = set(self.running_loras())
        skipped: list[Sequence] = []
        admitted = 0
        for seq in self._waiting:
            if budget <= 0 or len(self.running) >= options.max_num_seqs:
                break
            if seq.lora and seq.lora not in loras and len(loras) >= options.max_loras:
                skipped.append(seq)  # vLLM skips it and keeps scanning the queue
                continue
            num_tokens = len(seq.tokens)
            # The last token is always recomputed to get logits, so a hit covers at most num_tokens - 1.
            hits = self.cache.longest_hit(seq.block_hashes, (num_tokens - 1) // self._block_size)
            hit_hashes = seq.block_hashes[:hits]
            if not self.cache.can_allocate(hit_hashes, _ceil_div(num_tokens, self._block_size) - hits):
                break
            num_new = min(num_tokens - hits * self._block_size, budget)
            admitted += 1
            for block_hash in hit_hashes:
                self.cache.pin(block_hash)
            seq.held = list(hit_hashes)
            seq.settled_blocks = hits
            seq.num_computed = hits * self._block_size
            if seq.num_cached_tokens < 0:  # the first scheduling counts, not a preempted sequence's return
                seq.num_cached_tokens = seq.num_computed
                if self.cache.enable_caching:
                    seq.num_cache_creation_tokens = (num_tokens // self._block_size - hits) * self._block_size
            self._schedule(seq, num_new)
            budget -= num_new
            if self.cache.enable_caching:
                self.totals.prefix_cache_queries += num_tokens
                self.totals.prefix_cache_hits += hits * self._block_size
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            if seq.lora:
                loras.add(seq.lora)
        if admitted:
            self._waiting = skipped + self._waiting[admitted + len(skipped) :]

    def _schedule(self, seq: Sequence, num_new: int) -> None:
        """Schedule `num_new` more tokens of a sequence: hold their blocks and count them computed."""
        seq.num_scheduled = num_new
        seq.num_computed += num_new
        self._allocate(seq)

    def _allocate(self, seq: Sequence) -> None:
        """Hold blocks for the sequence's computed tokens and publish the full ones to the cache."""
        for _ in range(_ceil_div(seq.num_computed, self._block_size) - len(seq.held)):
            self.cache.allocate()
            seq.held.append(None)
        full_blocks = seq.num_computed // self._block_size
        self._hash_blocks(seq)
        stored: list[int] = []
        for index in range(seq.settled_blocks, full_blocks):
            if seq.held[index] is None and self.cache.register(seq.block_hashes[index]):
                seq.held[index] = seq.block_hashes[index]
                stored.append(index)
        seq.settled_blocks = full_blocks
        if self.events is not None and stored:
            self._report_stored(seq, stored)

    def _hash_blocks(self, seq: Sequence) -> None:
        """Hash the sequence's new full blocks: sha256_cbor as vLLM does when KV events are on, else xxh3."""
        if self._hasher is not None:
            self._hasher.extend(seq.block_hashes, seq.block_digests, seq.tokens, self._block_size, seq.lora,
                                seq.cache_salt)
        else:
            extend_block_hashes(seq.block_hashes, seq.tokens, self._block_size, seq.lora, seq.cache_salt)

    def _report_stored(self, seq: Sequence, indices: list[int]) -> None:
        """One BlockStored event per run of consecutive newly cached blocks, as vLLM reports them."""
        assert self.events is not None
        size = self._block_size
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            extra = [tuple(k for k in (seq.lora, seq.cache_salt if index == 0 else None) if k) or None
                     for index in run]
            self.events.append(BlockStored(
                block_hashes=tuple(seq.block_hashes[first:last + 1]),
                parent_block_hash=seq.block_hashes[first - 1] if first else None,
                token_ids=seq.tokens.ids(first * size, (last + 1) * size), block_size=size,
                lora_name=seq.lora, extra_keys=tuple(extra), medium="GPU"))

    def drain_events(self) -> list[KvEvent]:
        """The KV events since the last call (none when KV events are off)."""
        if not self.events:
            return []
        drained = list(self.events)
        self.events.clear()
        return drained

    def _free(self, seq: Sequence) -> None:
        self.cache.release(seq.held)
        seq.held = []
        seq.settled_blocks = 0
        seq.num_computed = 0

    @staticmethod
    def _finish(seq: Sequence, reason: FinishReason) -> None:
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
