"""Host RAM tier: block payloads by content key, LRU under a byte budget. Thread-safe.

A block can be pinned (counted): the pager pins the blocks a live bounded sequence paged
out, so they are never evicted while it may page them back in."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class HostTier:
    name = "host"

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # least recently used first
        self._pins: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self.stats = {"lookups": 0, "hit_blocks": 0, "bytes_read": 0, "bytes_written": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are held here."""
        with self._lock:
            self.stats["lookups"] += 1
            n = 0
            while n < len(keys) and keys[n] in self._blocks:
                n += 1
            return n

    def put(self, key: bytes, payload: torch.Tensor, pin: bool = False) -> bool:
        """Store a payload (the caller gives up the tensor: it is kept, not copied); with pin, also
        pin it. False if it could not be stored (larger than the budget, unless pinned)."""
        size = payload.numel() * payload.element_size()
        if size > self.budget_bytes and not pin:
            return False
        with self._lock:
            if pin:
                self._pins[key] = self._pins.get(key, 0) + 1
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            self._blocks[key] = payload
            self.bytes_used += size
            self.stats["bytes_written"] += size
            self._evict()
            return True

    def pin(self, key: bytes) -> bool:
        """Pin a block already held here; False if it is not."""
        with self._lock:
            if key not in self._blocks:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: bytes) -> None:
        with self._lock:
            count = self._pins.pop(key) - 1
            if count:
                self._pins[key] = count
            self._evict()

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self._blocks[key].numel() * self._blocks[key].element_size() for key in self._pins)

    def get(self, key: bytes) -> torch.Tensor | None:
        runs = self.get_run([key])
        return runs[0] if runs else None

    def _evict(self) -> None:
        """Drop least recently used unpinned blocks until within budget (pinned blocks may exceed it)."""
        if self.bytes_used <= self.budget_bytes:
            return
        for key in list(self._blocks):
            if self.bytes_used <= self.budget_bytes:
                return
            if key not in self._pins:
                old = self._blocks.pop(key)
                self.bytes_used -= old.numel() * old.element_size()
                self.stats["evictions"] += 1

    def get_run(self, keys: list[bytes]) -> list[torch.Tensor] | None:
        """Payloads of all keys, or None if any has been evicted meanwhile."""
        with self._lock:
            if any(k not in self._blocks for k in keys):
                return None
            payloads = []
            for k in keys:
                self._blocks.move_to_end(k)
                payloads.append(self._blocks[k])
            self.stats["hit_blocks"] += len(keys)
            self.stats["bytes_read"] += sum(p.numel() * p.element_size() for p in payloads)
            return payloads
