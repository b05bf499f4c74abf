"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running decodes first (one token each, oldest first), then prefill chunks of
running sequences, then new admissions while budget, sequence slots and free blocks last.
When the pool runs dry, the newest unscheduled running sequence is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later. Under bounded
residency the pager sizes each chunk and pages blocks out before new ones are reserved.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.kv.pager import NOT_RESIDENT, Pager
from kvtier.kv.pool import KVPool


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # tokens to compute this step, per sequence
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, pool: KVPool, max_batched_tokens: int, max_num_seqs: int, pager: Pager | None = None):
        self.pool = pool
        self.pager = pager
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # in arrival order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_batched_tokens
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decoding:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this step
                continue
            if self._reserve(seq, 1, batch):
                batch.add(seq, 1)
                budget -= 1
            else:
                self._preempt(seq, batch)
        for seq in prefilling:
            if budget == 0:
                break
            n = self._chunk(seq, budget)
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, n, batch):
                batch.add(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if seq.residency and not self.pager.reserve_host(seq):
                break     # its paged-out blocks would pass the host budget: wait for running sequences to end
            if seq.block_table:     # restored from a lower tier: it already holds its prefix blocks
                cached, keys = [], seq.block_keys
            else:
                limit = self.pager.max_shared_blocks if self.pager else None
                cached, keys = self.pool.match_prefix(seq.token_ids, limit, seq.root_key)
                seq.num_computed_tokens = len(cached) * self.pool.block_size
            held = seq.block_table + cached
            n = self._chunk(seq, budget)
            if seq.residency and seq.block_table:     # restored over its budget: make room before growing
                self.pager.make_room(seq, seq.num_computed_tokens + n)
                held = seq.block_table
            need = max(0, self.pool.blocks_for(seq.num_computed_tokens + n) - len(held))
            if not self.pool.can_allocate(need):
                self.pool.free(cached)
                break
            self.waiting.popleft()
            seq.block_table = held + self.pool.allocate(need)
            seq.block_keys = keys
            if seq.num_output_tokens == 0 and cached:   # a preempted sequence keeps its first report
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.tier_tokens["device"] = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        self.running.sort(key=lambda s: s.arrival)
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        return self.pager.limit_chunk(seq, seq.num_computed_tokens, n) if seq.residency else n

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Give seq blocks for n more tokens, preempting newer unscheduled sequences if needed."""
        if seq.residency:
            self.pager.make_room(seq, seq.num_computed_tokens + n)
        need = self.pool.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
        while not self.pool.can_allocate(need):
            victims = [s for s in self.running if s.arrival > seq.arrival and s not in batch.seqs]
            if not victims:
                return False
            self._preempt(victims[-1], batch)
        seq.block_table += self.pool.allocate(need)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.residency:
            self.pager.release(seq)
        self.pool.free([b for b in seq.block_table if b != NOT_RESIDENT])
        seq.block_table = []
        if seq in self.running:
            self.running.remove(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
