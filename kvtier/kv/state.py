"""One request's KV state. The KV manager (manager.py) is its only writer; the scheduler and the
runner read it."""
from __future__ import annotations

from dataclasses import dataclass, field

NOT_RESIDENT = -1    # a block table entry whose block waits in a lower tier (bounded residency)


@dataclass(eq=False)
class KVState:
    request_id: str
    token_ids: list[int]                    # the sequence's tokens, shared with it (it appends, we read)
    max_tokens: int                         # the most tokens the sequence may reach: prompt + max_tokens
    root_key: bytes | None = None           # the first block's parent: a cache salt's, or None
    block_table: list[int] = field(default_factory=list)   # logical block → device block, or NOT_RESIDENT
    block_keys: list[bytes] = field(default_factory=list)  # content keys of the sealed (full, computed) blocks
    prompt_keys: list[bytes] | None = None  # exact keys of the prompt's full blocks, hashed once at lookup
    residency: object | None = None         # the pager's Residency under bounded residency, else None
    num_computed: int = 0                   # tokens whose K/V are in its blocks, as of the last commit
    restored: int = 0                       # tokens a finished load put in block_table, not yet taken up
    loading: bool = False                   # a load into its reserved blocks is in flight
    load_from: int = 0                      # the token where the loaded blocks begin
    compute_first: bool = False             # it computes its prefix up to load_from while the rest loads
    landed_keys: list[bytes] = field(default_factory=list)   # a compute_first load's keys, joined at load_from
    looked_up: bool = False                 # the lower tiers were searched for its prefix
    aborted: bool = False                   # cancelled while loading: released once the copy lands
    admitted: bool = False                  # admitted once: a preempted sequence keeps its first cache report
    num_cached_tokens: int = 0              # prompt tokens served from a cache
    # prompt tokens the cache held at lookup (device, tiers, partial blocks), served or computed again: what makes a
    # prompt short for ggml's decode steps (engine/runner.py), whatever compute-or-load chose
    held_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)   # of those, how many came from which tier

    @property
    def waits_for_pages(self) -> bool:
        """Not schedulable now: blocks the pager chose to bring back are still being copied in (they join its table
        once landed, before its next step, however fast the copies ran)."""
        return self.residency is not None and bool(self.residency.paging_in)

    @property
    def waits_for_load(self) -> bool:
        """Not admissible yet: its whole cached prefix is loading."""
        return self.loading and not self.compute_first
