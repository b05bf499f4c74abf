"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running decodes first (one token each, oldest first, with the tokens a speculating
sequence proposed after it: a verify step), then prefill chunks of
running sequences, then new admissions while budget, sequence slots and free blocks last.
Beside running decodes, the pacer (pacer.py) sizes the prompt tokens a step may carry so
that the streams keep their inter-token latency while a long prompt prefills.
A waiting sequence whose prefix is loading from a lower tier is passed over until it lands,
unless it computes its front meanwhile (then it runs up to the loading blocks and waits there).
When the pool runs dry, the newest unscheduled running sequence is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later. Where blocks
come from and go to is the KV manager's business (kv/manager.py); this decides who runs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvtier.engine.pacer import Pacer
from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.kv.manager import KVManager


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # tokens to compute this step, per sequence
    num_decodes: int = 0          # of the sequences, those decoding: one token, or one and its draft (a verify step)
    num_drafted: int = 0          # the draft tokens those carry
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, kv: KVManager, max_batched_tokens: int, max_num_seqs: int, max_itl_ratio: float = 0):
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.pacer = Pacer(max_batched_tokens, max_itl_ratio)
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
        prompts_pending = bool(prefilling or self.waiting)
        for i, seq in enumerate(decoding):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.kv.waits_for_pages:   # preempted earlier in this step,
                continue                                                             # or its page-ins are landing
            if not self._reserve(seq, 1, batch):
                self._preempt(seq, batch)
                continue
            # a draft takes only what costs no one anything: budget the other decodes (and half of what is left,
            # while prompts wait) do not need, and blocks that are empty
            room = budget - 1 - (len(decoding) - i - 1)
            room -= room // 2 if prompts_pending else 0
            end = seq.num_computed_tokens + 1
            drafted = self.kv.reserve_draft(seq.kv, end, min(len(seq.draft), room)) if seq.draft and room > 0 else 0
            del seq.draft[drafted:]
            batch.add(seq, 1 + drafted)
            batch.num_decodes += 1
            batch.num_drafted += drafted
            budget -= 1 + drafted
        budget = min(budget, self.pacer.budget(batch.num_decodes))
        for seq in prefilling:
            if budget == 0:
                break
            if seq.kv.waits_for_pages:
                continue
            seq.num_computed_tokens = self.kv.take_landed(seq.kv, seq.num_computed_tokens)
            n = self.kv.chunk(seq.kv, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
            if n == 0:      # waiting for its loading blocks
                continue
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, n, batch):
                batch.add(seq, n)
                budget -= n
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs or batch.preempted:
                break
            if seq.kv.waits_for_load or seq.drafter_loading:
                continue
            admitted = self.kv.admit(seq.kv, budget)
            if admitted is None:
                break
            seq.num_computed_tokens, n = admitted
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        self.running.sort(key=lambda s: s.arrival)
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Give seq blocks for n more tokens, preempting newer unscheduled sequences if needed."""
        while not self.kv.reserve(seq.kv, seq.num_computed_tokens + n):
            victims = [s for s in self.running if s.arrival > seq.arrival and s not in batch.seqs
                       and not s.kv.loading]     # never blocks a copy is writing into
            if not victims:
                return False
            self._preempt(victims[-1], batch)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.kv.release(seq.kv)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.draft = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """A sequence that stopped or reached its length leaves its KV for later requests (a bounded one, its
        manifest too); an aborted or failed one just gives its blocks back."""
        if reason in ("stop", "length"):
            self.kv.finish(seq.kv)
        else:
            self.kv.release(seq.kv)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
