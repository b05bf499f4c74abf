"""Host RAM tier: block payloads by content key in one slab of block slots, allocated once and sized by
the budget (pinned memory when the pool is on CUDA, so copies to and from the device are DMA), LRU.
Thread-safe.

At start-up the mover's read buffers are carved from the slab's top slots (`carve`), so that the budget covers
every byte of host memory kvtier keeps.

A block can be pinned (counted): the pager pins the blocks a live bounded sequence paged out, and a
reader leases the blocks it copies from (`lease` or `read_run`, then `release`), so a slot is never reused while
someone may still read it."""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch


class HostTier:
    name = "host"

    def __init__(self, budget_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False):
        self.block_shape = tuple(block_shape)
        self.block_bytes = math.prod(self.block_shape) * dtype.itemsize
        self.num_slots = budget_bytes // self.block_bytes
        self.budget_bytes = self.num_slots * self.block_bytes
        self.slab = torch.empty((self.num_slots, *self.block_shape), dtype=dtype, pin_memory=pin_memory)
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._slots: OrderedDict[bytes, int] = OrderedDict()   # key → slot, least recently used first
        self._pins: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self.stats = {"lookups": 0, "hit_blocks": 0, "bytes_read": 0, "bytes_written": 0, "evictions": 0}

    def carve(self, nbytes: int) -> torch.Tensor:
        """Take whole slots from the top of the slab, for good, as a buffer of at least nbytes bytes (uint8). Only
        at start-up, before any block is stored."""
        taken = -(-nbytes // self.block_bytes)
        first = self.num_slots - taken
        if first < 0 or any(slot >= first for slot in self._slots.values()):
            raise ValueError(f"the host tier has no {taken} free slots left for a {nbytes}-byte buffer")
        self.num_slots = first
        self._free_slots = [slot for slot in self._free_slots if slot < first]
        return self.slab[first:first + taken].view(-1).view(torch.uint8)

    @property
    def block_budget_bytes(self) -> int:
        """What its slots for blocks hold (the budget less the carved buffers): the most that may be pinned."""
        return self.num_slots * self.block_bytes

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def bytes_used(self) -> int:
        return len(self._slots) * self.block_bytes

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._slots

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are held here."""
        with self._lock:
            self.stats["lookups"] += 1
            n = 0
            while n < len(keys) and keys[n] in self._slots:
                n += 1
            return n

    def put(self, key: bytes, payload: torch.Tensor, pin: bool = False) -> bool:
        """Copy a payload in; with pin, also pin it. False if no slot could be freed for it. The copy runs outside
        the lock (into a slot no one else can see yet), so readers of other blocks never wait for it."""
        with self._lock:
            if key in self._slots:
                return self._touch(key, pin)
            slot = self._take_slot()
            if slot is None:
                return False
        self.slab[slot].copy_(payload)
        with self._lock:
            if key in self._slots:      # another writer put it meanwhile
                self._free_slots.append(slot)
            else:
                self._slots[key] = slot
                self.stats["bytes_written"] += self.block_bytes
            return self._touch(key, pin)

    def _touch(self, key: bytes, pin: bool) -> bool:
        """(Under the lock.) A held block becomes the most recently used, pinned once more with pin."""
        self._slots.move_to_end(key)
        if pin:
            self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def put_run(self, keys: list[bytes], payloads) -> None:
        for key, payload in zip(keys, payloads):
            self.put(key, payload)

    def pin(self, key: bytes) -> bool:
        """Pin a block already held here; False if it is not."""
        with self._lock:
            if key not in self._slots:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: bytes) -> None:
        with self._lock:
            count = self._pins.pop(key) - 1
            if count:
                self._pins[key] = count

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return len(self._pins) * self.block_bytes

    def extra_stats(self) -> dict:
        return {"pinned_bytes": self.pinned_bytes, "buffer_bytes": self.budget_bytes - self.block_budget_bytes}

    def lease(self, keys: list[bytes]) -> list[torch.Tensor] | None:
        """Views of the slots of all keys, pinned until `release(keys)`; None if any is absent."""
        with self._lock:
            if any(k not in self._slots for k in keys):
                return None
            for k in keys:
                self._slots.move_to_end(k)
                self._pins[k] = self._pins.get(k, 0) + 1
            return [self.slab[self._slots[k]] for k in keys]

    def read_run(self, keys: list[bytes], staging=None) -> list[torch.Tensor] | None:
        """A reader's lease (see `lease`), counted as a hit."""
        views = self.lease(keys)
        with self._lock:
            self.stats["hit_blocks"] += len(keys) if views is not None else 0
            self.stats["bytes_read"] += len(keys) * self.block_bytes if views is not None else 0
        return views

    def release(self, keys: list[bytes]) -> None:
        for k in keys:
            self.unpin(k)

    def get_run(self, keys: list[bytes], staging=None) -> list[torch.Tensor] | None:
        """Copies of the payloads of all keys, or None if any is absent."""
        views = self.read_run(keys)
        if views is None:
            return None
        try:
            return [v.clone() for v in views]
        finally:
            self.release(keys)

    def _take_slot(self) -> int | None:
        """(Under the lock.) A free slot, evicting the least recently used unpinned block if none is."""
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((k for k in self._slots if k not in self._pins), None)
        if victim is None:
            return None
        self.stats["evictions"] += 1
        return self._slots.pop(victim)
