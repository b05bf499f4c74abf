"""Bounded residency: at most `budget_blocks` of a sequence's blocks are on the device.

Decode steps attend to the resident blocks only: their cost and device memory stop growing
with the context. Prompt chunks attend to every earlier block, the paged-out ones streamed
through one layer at a time (`paged_out_kv`), so a prompt's KV and first token are exact.

A block table entry of -1 means "not resident": that block's payload waits in the host tier,
pinned there for as long as the sequence lives. Always resident: the sink blocks (the
first), the tail (the last, including the one being filled) and blocks overlapping a
pinned token range. The rest of the budget goes to the best-scoring sealed blocks.

- `limit_chunk` keeps prefill chunks inside the budget: up to the budget's edge in one
  go, then as many blocks as the budget holds beside the sink and the pins;
- `victims` picks the lowest-scoring blocks to page out before a step adds new ones;
- `after_step` scores every sealed block when a reselection is due and says which losers
  to page out and which winners to page in:
  once when the prompt is done, with its last queries, then every `reselect_every`
  decode tokens, or at once when a decode step's queries give a paged-out block a large
  share of some head's attention (the answer to a question turns to where it was said).
  Scores are kept in a ledger that fades by LEDGER_DECAY per step;
- `manifest` / `restore` save and bring back a sequence's pager state (see manifest.py):
  only resident blocks return to the device; the loader pins the others in the host tier
  (reading from disk those it lacks), and they are paged in from there when selected.

The pager decides; the KV manager (manager.py) moves the blocks and writes the block tables.

A block is exact, and keyed in the exact namespace, until a decode step computes one of its
tokens over a partial resident set; from that block on, keys are in the bounded namespace.
Works on a request's KVState (state.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvtier.kv.keys import block_key
from kvtier.kv.manifest import Manifest
from kvtier.kv.pool import KVPool
from kvtier.kv.scorer import SUMMARIES, BlockSummaries, attention_share
from kvtier.kv.state import NOT_RESIDENT

log = logging.getLogger("kvtier.kv.pager")

CAPTURE_ROWS = 16     # the last queries of a prefill chunk kept for scoring
# A decode step whose queries give a paged-out block at least this share of one head's attention reselects
# without waiting for its turn. On 8K chats recalling a pass key with a 512-token budget, 0.5 reacted too
# late for a key spread over two blocks; 0.3 recalled it.
SHIFT_SHARE = 0.3
# The score ledger: a block keeps this share of its last step's score. An answer reads one block for a few
# steps, and one step's queries looking elsewhere (at other numbers, say) should not page it out at once.
# In the NIAH chat probe, 0.5 lost the last digit of a key told early in the chat; 0.7 kept it.
LEDGER_DECAY = 0.7


class PinRefused(ValueError):
    """Pinned ranges that leave no room in the budget, or that fall outside the prompt."""


@dataclass
class Residency:
    """One sequence's pager state: the pins and the score ledger."""
    pins: list[tuple[int, int]] = field(default_factory=list)   # half-open token ranges
    summaries: BlockSummaries = field(default_factory=BlockSummaries)
    stamps: list[int] = field(default_factory=list)             # per sealed block: when it last became resident
    ledger: torch.Tensor | None = None                          # per sealed block: its score at the last step
    offloaded: set[int] = field(default_factory=set)            # blocks whose payload is pinned in the host tier
    paging_in: dict[int, int] = field(default_factory=dict)     # blocks whose page-in is in flight → device block
    queries: torch.Tensor | None = None                         # the latest queries seen [rows, layers, heads, dim]
    decoded_since_reselect: int = 0
    prompt_reselected: bool = False
    bounded_from: int | None = None      # the first token computed over a partial resident set
    host_reserved: int = 0               # bytes of the host tier promised to its paged-out blocks


class Pager:
    def __init__(self, pool: KVPool, host_budget_bytes: int, budget_blocks: int, sink_blocks: int,
                 tail_blocks: int, policy: str, reselect_every: int, scale: float, exact_namespace: bytes,
                 bounded_namespace: bytes):
        self.pool, self.host_budget_bytes = pool, host_budget_bytes
        self.budget_blocks, self.sink_blocks, self.tail_blocks = budget_blocks, sink_blocks, tail_blocks
        self.policy, self.reselect_every, self.scale = policy, reselect_every, scale
        self.exact_namespace, self.bounded_namespace = exact_namespace, bounded_namespace
        self.stats = {"page_ins": 0, "page_outs": 0, "reselects": 0, "reselect_seconds": 0.0,
                      "max_resident_blocks": 0}
        self.host_reserved = 0     # bytes of the host tier promised to admitted sequences, at most its budget
        self._tick = 0

    # --- admission -------------------------------------------------------------------------------

    def new_residency(self, pins: list[tuple[int, int]] | None, num_prompt_tokens: int) -> Residency:
        """A sequence's pager state; raises PinRefused for pins it cannot honour."""
        pins = [tuple(p) for p in pins or []]
        for start, end in pins:
            if not 0 <= start < end <= num_prompt_tokens:
                raise PinRefused(f"pin [{start}, {end}) is not a non-empty range inside the "
                                 f"{num_prompt_tokens}-token prompt")
        res = Residency(pins=pins)
        pinned = self._pinned_blocks(res) - set(range(self.sink_blocks))
        if self.sink_blocks + self.tail_blocks + len(pinned) + 1 > self.budget_blocks:
            raise PinRefused(
                f"the pins cover {len(pinned)} blocks of {self.pool.block_size} tokens; with {self.sink_blocks} sink "
                f"and {self.tail_blocks} tail blocks the residency budget of {self.budget_blocks} blocks would leave "
                "no room for a scored block; pin less or raise --kv-resident-tokens")
        return res

    def host_bytes_for(self, num_tokens: int) -> int:
        """The most host-tier bytes a sequence of num_tokens may pin. Nothing if it fits its budget; else a block
        once paged out stays pinned, paged back in or not, so every block but the sink and the final tail."""
        blocks = self.pool.blocks_for(num_tokens)
        if blocks <= self.budget_blocks:
            return 0
        return (blocks - self.sink_blocks - self.tail_blocks) * self.pool.block_bytes

    def reserve_host(self, state) -> bool:
        """Promise the sequence room in the host tier for all it may page out; False (it waits) while the
        promises to the sequences admitted before it leave too little of the budget."""
        res = state.residency
        need = self.host_bytes_for(state.max_tokens)
        if res.host_reserved or not need:
            return True
        if self.host_reserved + need > self.host_budget_bytes:
            return False
        res.host_reserved = need
        self.host_reserved += need
        return True

    @property
    def max_pinned_tokens(self) -> int:
        """The most prompt tokens, from the start, that pins may keep resident (beside the tail and one scored
        block; the sink lies inside them)."""
        return (self.budget_blocks - self.tail_blocks - 1) * self.pool.block_size

    @property
    def max_shared_blocks(self) -> int:
        """Blocks a new sequence may take from a prefix cache: its first chunk must still fit the budget."""
        return self.budget_blocks - self.tail_blocks

    def namespace_for(self, state, block: int) -> bytes:
        bounded = state.residency.bounded_from
        if bounded is not None and (block + 1) * self.pool.block_size > bounded:
            return self.bounded_namespace
        return self.exact_namespace

    def manifest_key(self, exact_key: bytes) -> bytes:
        """Where the manifest of a prefix is stored: by its exact key (its tokens), in the bounded namespace."""
        return block_key(exact_key, [], self.bounded_namespace)

    # --- manifests -------------------------------------------------------------------------------

    def manifest(self, state) -> Manifest:
        res = state.residency
        self.sealed(state)                  # brings the summaries up to date
        scores = res.ledger if res.ledger is not None else torch.zeros(len(res.summaries))
        tensors = {**{name: getattr(res.summaries, name).clone() for name in SUMMARIES}, "scores": scores}
        if res.queries is not None:
            tensors["queries"] = res.queries
        return Manifest(list(state.block_keys), [b != NOT_RESIDENT for b in state.block_table[:len(state.block_keys)]],
                        list(res.stamps), res.decoded_since_reselect, list(res.pins), tensors, res.bounded_from)

    def restore(self, state, manifest: Manifest) -> None:
        """Take up a saved sequence's pager state (its block table is the manager's to build)."""
        res, device = state.residency, self.pool.device
        res.summaries = BlockSummaries()
        res.summaries.extend({name: manifest.tensors[name].to(device) for name in SUMMARIES})
        res.stamps = list(manifest.stamps)
        res.ledger = manifest.tensors["scores"].cpu()
        self._tick = max([self._tick, *res.stamps])
        queries = manifest.tensors.get("queries")
        res.queries = None if queries is None else queries.to(device)
        res.decoded_since_reselect = manifest.decoded_since_reselect
        res.bounded_from = manifest.bounded_from
        res.pins = res.pins or list(manifest.pins)
        # a plain continuation (nothing new but the last sampled token) goes on as if never interrupted;
        # new prompt text gets its own reselection when it is done
        res.prompt_reselected = len(state.token_ids) - len(manifest.keys) * self.pool.block_size <= 1

    # --- scheduling ------------------------------------------------------------------------------

    def limit_chunk(self, state, num_computed: int, n: int) -> int:
        bs = self.pool.block_size
        edge = self.budget_blocks * bs
        if num_computed < edge:                   # exact so far: run up to the edge of the budget
            return min(n, edge - num_computed)
        # beyond it, every block the chunk writes is resident beside the sink and the pinned blocks
        held = len(self._pinned_blocks(state.residency) | set(range(self.sink_blocks)))
        return min(n, (num_computed // bs + self.budget_blocks - held) * bs - num_computed)

    def victims(self, state, end: int) -> list[int]:
        """The blocks to page out so that the sequence stays in budget once it holds tokens 0 .. end-1."""
        num_blocks = self.pool.blocks_for(end)
        resident = self._resident(state)
        over = len(resident) + max(0, num_blocks - len(state.block_table)) - self.budget_blocks
        if over <= 0:
            return []
        protected = self._protected(state.residency, num_blocks)
        candidates = [i for i in resident if i not in protected and i < len(state.block_keys)]
        if len(candidates) < over:
            raise RuntimeError(f"{len(candidates)} evictable blocks, {over} needed: the budget checks failed")
        scores = self._scores(state)
        return sorted(candidates, key=lambda i: scores[i])[:over]

    # --- after a step ----------------------------------------------------------------------------

    def sealed(self, state) -> None:
        """Summarize the sequence's sealed blocks that have no key summary yet: just computed, or taken
        from a prefix cache (read from the device, kept on the device)."""
        bs, res = self.pool.block_size, state.residency
        if len(res.summaries) == len(state.block_keys):
            return
        for i in range(len(res.summaries), len(state.block_keys)):
            physical = state.block_table[i]
            res.summaries.add(self.pool.k_cache[:, physical * bs:(physical + 1) * bs])
            res.stamps.append(self._next_tick())
        self._note_peak(state)

    def after_step(self, state, queries: torch.Tensor | None, num_computed: int, prompt_done: bool,
                   decoded: bool) -> tuple[list[int], list[int]]:
        """Keep the step's queries; when a reselection is due, the blocks to page out and to page in."""
        res = state.residency
        if queries is not None:
            res.queries = queries
        if not self._is_over(state):
            return [], []
        if decoded and res.bounded_from is None:
            res.bounded_from = num_computed - 1
        if not (decoded or prompt_done):
            return [], []
        start = time.perf_counter()
        scores = self._scores(state)
        if self.policy != "lru":
            res.ledger = scores
        self.stats["reselect_seconds"] += time.perf_counter() - start
        if prompt_done and not res.prompt_reselected:
            res.prompt_reselected = True
            return self.reselect(state, scores)
        # a restored continuation's one-token prompt is its next decode step
        res.decoded_since_reselect += 1
        if res.decoded_since_reselect >= self.reselect_every or self._query_shifted(state, scores):
            res.decoded_since_reselect = 0
            return self.reselect(state, scores)
        return [], []

    def mark_bounded(self, state, position: int) -> None:
        """Tokens from `position` on were computed over a partial resident set (a drafter's rounds, or features of
        such tokens): their blocks are keyed in the bounded namespace."""
        res = state.residency
        res.bounded_from = position if res.bounded_from is None else min(res.bounded_from, position)

    def reselect(self, state, scores: torch.Tensor) -> tuple[list[int], list[int]]:
        """Resident set := protected blocks + the best-scoring others: (losers to page out, winners to page in)."""
        start = time.perf_counter()
        res = state.residency
        num_blocks = len(state.block_table)
        # blocks a prompt chunk has just filled are sealed after this: they stay, like the tail
        protected = self._protected(res, num_blocks) | set(range(len(state.block_keys), num_blocks))
        room = self.budget_blocks - len(protected & set(range(num_blocks)))
        candidates = [i for i in range(len(state.block_keys)) if i not in protected]
        winners = set(sorted(candidates, key=lambda i: scores[i], reverse=True)[:room])
        self.stats["reselects"] += 1
        self.stats["reselect_seconds"] += time.perf_counter() - start
        return ([i for i in candidates if i not in winners and self._holds(state, i)],
                [i for i in sorted(winners) if not self._holds(state, i)])

    def release(self, state) -> None:
        """The sequence is gone or starts over (its host copies unpinned by the manager): give back its
        promised room in the host tier and forget its ledger."""
        res = state.residency
        self.host_reserved -= res.host_reserved
        state.residency = Residency(pins=res.pins)

    # --- internals -------------------------------------------------------------------------------

    def _scores(self, state) -> torch.Tensor:
        """One score per sealed block, higher is better."""
        self.sealed(state)
        res = state.residency
        if self.policy == "lru" or res.queries is None or not len(res.summaries):
            return torch.tensor(res.stamps, dtype=torch.float32)   # recency
        shares = attention_share(self.policy, res.summaries, res.queries, self.scale).cpu()
        # what is read is read on into the next block (a key, a quote): a block scores at least its predecessor's
        shares[1:] = torch.maximum(shares[1:], shares[:-1].clone())
        if res.ledger is not None:
            past = torch.zeros_like(shares)
            past[:len(res.ledger)] = res.ledger[:len(shares)]
            shares = torch.maximum(shares, LEDGER_DECAY * past)
        return shares

    def _query_shifted(self, state, scores: torch.Tensor) -> bool:
        if self.policy == "lru":      # recency scores say nothing about the queries
            return False
        paged_out = [i for i in range(len(scores)) if not self._holds(state, i)]
        return bool(paged_out) and float(scores[paged_out].max()) >= SHIFT_SHARE

    def placed(self, state, i: int) -> None:
        """Block i has just been paged in."""
        state.residency.stamps[i] = self._next_tick()
        self._note_peak(state)

    def _note_peak(self, state) -> None:
        """Residency grows only when blocks seal or are paged in: the peak is seen by calling this then."""
        self.stats["max_resident_blocks"] = max(self.stats["max_resident_blocks"], len(self._resident(state)))

    def _resident(self, state) -> list[int]:
        return [i for i in range(len(state.block_table)) if self._holds(state, i)]

    @staticmethod
    def _holds(state, i: int) -> bool:
        """Block i is resident, or its page-in is in flight: it counts against the budget."""
        return state.block_table[i] != NOT_RESIDENT or i in state.residency.paging_in

    def _is_over(self, state) -> bool:
        return len(state.block_table) > self.budget_blocks

    def _pinned_blocks(self, res: Residency) -> set[int]:
        bs = self.pool.block_size
        return {b for start, end in res.pins for b in range(start // bs, -(-end // bs))}

    def _protected(self, res: Residency, num_blocks: int) -> set[int]:
        sinks = range(min(self.sink_blocks, num_blocks))
        tail = range(max(0, num_blocks - self.tail_blocks), num_blocks)
        return {*sinks, *tail} | self._pinned_blocks(res)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick
