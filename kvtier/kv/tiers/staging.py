"""A reusable read buffer for the tiers that read into one (the disk tier) and for the gather of paged-out blocks."""
from __future__ import annotations

import time

import torch


class Staging:
    """A reusable read buffer, kept faulted in: reading into fresh memory pays a page fault
    per page, which on this kind of machine halves the file-read rate. Grows to the largest
    restore up to `max_bytes`, with a quarter to spare (growing by exactly what a slightly longer restore
    needs, as a conversation's do, would fault a whole new buffer in each time); larger restores read
    into fresh buffers. Pinned for a CUDA pool, so the copy to the device that follows is DMA."""

    def __init__(self, max_bytes: int, pin_memory: bool = False):
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.grow_seconds = 0.0     # spent faulting new buffers in: a one-time cost, not a tier's read time

    def split(self, sizes: list[int], room: int = 0) -> list[torch.Tensor | None]:
        """Consecutive pieces of the buffer of these sizes (all None past max_bytes). A buffer too small grows to
        at least `room`: what the caller knows it will soon ask for."""
        total = sum(sizes)
        if total > self.max_bytes:
            return [None] * len(sizes)
        if total > self.buffer.numel():
            start = time.perf_counter()
            self._grow(min(self.max_bytes, max(room, total + total // 4)))
            self.grow_seconds += time.perf_counter() - start
        return list(self.buffer[:total].split(sizes))

    def reserve(self, size: int) -> None:
        """Grow to size (at most max_bytes) now, at start-up, so that no request pays for the page faults."""
        self.split([min(size, self.max_bytes)])

    def _grow(self, size: int) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)      # the old one goes first
        self.buffer = torch.zeros(size, dtype=torch.uint8, pin_memory=self.pin_memory)  # zeros: fault pages in now
