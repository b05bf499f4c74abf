"""Host RAM tier: block payloads by content key, LRU under a byte budget. Thread-safe."""
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

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        """Store a payload (the caller gives up the tensor: it is kept, not copied)."""
        size = payload.numel() * payload.element_size()
        if size > self.budget_bytes:
            return
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = payload
            self.bytes_used += size
            self.stats["bytes_written"] += size
            while self.bytes_used > self.budget_bytes:
                _, old = self._blocks.popitem(last=False)
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
