"""What every tier below the device is: a store of block payloads by content key, with a budget.

A new tier is one file with a class of this shape and one entry in `stack.EXTRA_TIERS`; nothing else in kvtier
names it. The engine's thread calls only `contains` and `match_prefix`, which answer from memory (an index the tier
keeps: a tier whose store is remote refreshes its own from a thread of its own, and may answer a key late, never
slowly), and the host tier's `lease`/`release` where the mover gathers paged-out blocks from host memory; the
mover's workers make every other call. Eviction is each tier's own business: `put_run` evicts least
recently used blocks to stay within the budget. Pinning and leasing slots (host.py) belong to the host tier, and
only the mover calls them."""
from __future__ import annotations

from typing import Protocol

import torch


class Tier(Protocol):
    name: str                 # "host", "disk", ...: the label of its metrics
    budget_bytes: int
    bytes_used: int
    stats: dict               # lookups, hit_blocks, bytes_read, bytes_written, evictions, ...

    def contains(self, key: bytes) -> bool: ...

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are held here."""

    def read_run(self, keys: list[bytes], staging=None) -> list[torch.Tensor] | None:
        """Payloads of all keys, valid until `release(keys)` (in `staging` where the tier reads into a buffer),
        or None (a miss) if any is absent or damaged."""

    def release(self, keys: list[bytes]) -> None:
        """The reader is done with what read_run gave it."""

    def get_run(self, keys: list[bytes], staging=None) -> list[torch.Tensor] | None:
        """Payloads of all keys that the caller owns (nothing to release), or None (`staging` as read_run's)."""

    def put_run(self, keys: list[bytes], payloads: list[torch.Tensor]) -> None:
        """Store a run of blocks, evicting least recently used ones to stay within the budget."""

    def extra_stats(self) -> dict:
        """Gauges beyond the common ones, by name (pinned_bytes, enabled, ...): /metrics shows each as
        kvtier_kv_tier_<name>{tier=...}, unless the name is a common family's (server/metrics.py TIER_FAMILIES)."""
