"""What every tier below the device is: a store of block payloads by content key, with a budget."""
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

    def get_run(self, keys: list[bytes]) -> list[torch.Tensor] | None:
        """Payloads of all keys that the caller owns (nothing to release), or None."""

    def put_run(self, keys: list[bytes], payloads: list[torch.Tensor]) -> None:
        """Store a run of blocks, evicting least recently used ones to stay within the budget."""

    def extra_stats(self) -> dict:
        """Gauges beyond the common ones (pinned bytes, enabled, ...)."""
